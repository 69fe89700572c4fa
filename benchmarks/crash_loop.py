"""Kill the daemon at random points while workers store, restart it, check the history
(the drill is drills/crash.py; this prints its tables).

    python -m benchmarks.crash_loop --help
"""

from drills.crash import main

if __name__ == "__main__":
    main()
