"""What the engine counts about the bytes it moves, for whoever watches it (the daemon's
Prometheus endpoint, `tiercache stats`): bytes and copy times per hop between the
worker's buffers and the tiers (what matches found is in counters.py).

Plain Python, no exporter: the daemon reads `Traffic.snapshot()` and the engine's
counters when it is scraped, so every number has one owner.
"""

from __future__ import annotations

import bisect
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

# Where bytes can be: the worker's own buffers and the three tiers, nearest first.
PLACES = ("worker", "device", "host", "disk", "remote")
# Every hop a copy makes. A load from disk is two hops (disk -> host, host -> worker);
# device hops read zero until the engine has a device tier, remote hops without a
# remote tier. Remote entries land in host slots; disk entries go up from a disk read.
HOPS = (("worker", "device"), ("device", "worker"), ("worker", "host"), ("host", "worker"),
        ("device", "host"), ("host", "device"), ("host", "disk"), ("disk", "host"),
        ("host", "remote"), ("disk", "remote"), ("remote", "host"))
# Upper bounds of the copy-time buckets, seconds: 10 us (a few pages from host memory)
# to 10 s (a large batch to a slow disk).
BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
           0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class HopStats:
    bytes: int = 0  # every byte copied over the hop
    copies: int = 0  # timed copies (one a batch; asynchronous GPU loads are not timed)
    seconds: float = 0.0  # their total duration
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))  # per bucket, last +Inf

    def copy(self) -> "HopStats":
        return HopStats(self.bytes, self.copies, self.seconds, list(self.counts))


class Traffic:
    """Bytes and copy durations per hop. Thread-safe on its own small lock: disk reads
    and writes are timed outside the engine lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hops = {hop: HopStats() for hop in HOPS}

    def record(self, source: str, destination: str, nbytes: int, seconds: float | None) -> None:
        """`nbytes` copied from `source` to `destination`, taking `seconds` (None: not
        timed, e.g. a copy still running on a GPU stream)."""
        with self._lock:
            hop = self._hops[(source, destination)]
            hop.bytes += nbytes
            if seconds is not None:
                hop.copies += 1
                hop.seconds += seconds
                hop.counts[bisect.bisect_left(BUCKETS, seconds)] += 1

    @contextmanager
    def timed(self, source: str, destination: str, nbytes: int) -> Iterator[None]:
        """Record a copy that the body makes, if it completes."""
        start = time.perf_counter()
        yield
        self.record(source, destination, nbytes, time.perf_counter() - start)

    def snapshot(self) -> dict[tuple[str, str], HopStats]:
        with self._lock:
            return {hop: stats.copy() for hop, stats in self._hops.items()}


def byte_counters(traffic: dict[tuple[str, str], HopStats]) -> dict[str, int]:
    """The hops as flat counters ("bytes_host_to_disk"), for the Stats RPC."""
    return {f"bytes_{a}_to_{b}": stats.bytes for (a, b), stats in traffic.items()}
