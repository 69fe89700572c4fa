"""Sustained load: worker processes doing mixed match / load / store against a daemon
(the drill is drills/soak.py; this prints its tables).

    python -m benchmarks.soak --help
"""

from drills.soak import main

if __name__ == "__main__":
    main()
