"""Publish after commit under injected failures, for longer than the test runs it.

Two threads store and two load (every loaded byte checked against its key) on an engine
whose host tier holds 12 pages of a working set of 120 entries, so that stores evict,
evictions write to disk and loads promote disk entries, while failpoints raise at random:
between copying a store's bytes and publishing them, inside LMDB commits, while reading
disk entries and before a load writes the worker's rows (drills/publish.py).

    python -m benchmarks.publish_drill [--seconds 60]
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import threading
import time
from contextlib import ExitStack

from benchmarks.common import print_summary, print_table
from drills import publish as drill
from tiercache import failpoints

POINTS = {"store.before_publish": 0.2, "disk.before_commit": 0.2, "disk.read": 0.05,
          "load.before_scatter": 0.05}


def counting(name: str, chance: float, fired: collections.Counter):
    action = failpoints.parse_action(f"raise({chance})")

    def act(point: str) -> None:
        fired[f"{point} passed"] += 1
        try:
            action(point)
        except failpoints.InjectedFault:
            fired[f"{point} raised"] += 1
            raise
    return act


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60)
    args = parser.parse_args()
    fired: collections.Counter = collections.Counter()
    with tempfile.TemporaryDirectory() as folder:
        engine = drill.open_engine(folder, host_pages=12, writes="back")
        seeds, stop, errors, loaded = list(range(100, 124)), threading.Event(), [], []
        threads = [threading.Thread(target=drill.storer, args=(engine, seeds, stop, errors))
                   for _ in range(2)]
        threads += [threading.Thread(target=drill.loader, args=(engine, seeds, stop, errors, loaded))
                    for _ in range(2)]
        with ExitStack() as armed:
            for name, chance in POINTS.items():
                armed.enter_context(failpoints.armed(name, counting(name, chance, fired)))
            for thread in threads:
                thread.start()
            time.sleep(args.seconds)
            stop.set()
            for thread in threads:
                thread.join()
        counters = engine.stats().counters
        engine.close(flush=False)
    print_table(f"publish after commit: {args.seconds:.0f} s of stores and loads under failures",
                ["failpoint", "reached", "raised"],
                [(p, fired[f"{p} passed"], fired[f"{p} raised"]) for p in POINTS])
    hits = sum(pages > 0 for pages in loaded)
    print(f"loads {len(loaded)} ({hits} hits, every byte checked), stored entries "
          f"{counters['stored_pages'] + counters['stored_checkpoints']}, demoted "
          f"{counters['demoted']}, promoted {counters['promoted']}, errors {len(errors)}")
    print_summary(loads=len(loaded), hits=hits,
                  faults=sum(fired[f"{p} raised"] for p in POINTS),
                  incomplete_seen=sum(isinstance(e, AssertionError) for e in errors),
                  other_errors=sum(not isinstance(e, AssertionError) for e in errors))


if __name__ == "__main__":
    main()
