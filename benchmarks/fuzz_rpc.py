"""Fuzz every RPC with structure-aware random messages (hypothesis), then with raw
bytes (the drill is drills/fuzz.py; this prints its tables).

    python -m benchmarks.fuzz_rpc --help
"""

from drills.fuzz import main

if __name__ == "__main__":
    main()
