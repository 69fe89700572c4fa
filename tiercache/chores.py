"""The engine's long chores, watched: the startup rebuild of the index from the disk tier,
and the flush of the host tier to disk (at shutdown). Both can take minutes on a large
disk or host tier, so each logs when it starts, a progress line every few seconds while it
runs, and what it did and how long it took when it ends; the totals stay readable (the
daemon exposes them as metrics)."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

log = logging.getLogger("tiercache.engine")
PROGRESS_SECONDS = 5.0  # between progress lines of a chore still running


@dataclass
class ChoreStats:
    """What runs of one chore did so far: entries and seconds, over every run."""

    runs: int = 0
    entries: int = 0
    seconds: float = 0.0


@contextmanager
def watched(stats: ChoreStats, what: str, total: int, done: Callable[[], int],
            level: int = logging.INFO, every: float = PROGRESS_SECONDS) -> Iterator[None]:
    """Log `what` (e.g. "flushing the host tier to disk") for its `total` entries, a progress
    line every `every` seconds with `done()` entries so far, and the outcome; add the run to
    `stats` once the body ends, failed or not."""
    start, stop = time.monotonic(), threading.Event()
    log.log(level, "%s: %d entries", what, total, extra={"data": {"entries": total}})

    def progress() -> None:
        while not stop.wait(every):
            seconds = time.monotonic() - start
            log.info("%s: %d of %d entries after %.0f s", what, done(), total, seconds,
                     extra={"data": {"entries": done(), "of": total, "seconds": round(seconds, 1)}})

    ticker = threading.Thread(target=progress, name="tiercache-progress", daemon=True)
    ticker.start()
    failed = True
    try:
        yield
        failed = False
    finally:
        stop.set()
        ticker.join()
        seconds, entries = time.monotonic() - start, done()
        stats.runs += 1
        stats.entries += entries
        stats.seconds += seconds
        log.log(logging.WARNING if failed else level, "%s: %s, %d entries in %.2f s", what,
                "failed" if failed else "done", entries, seconds,
                extra={"data": {"entries": entries, "seconds": round(seconds, 3)}})
