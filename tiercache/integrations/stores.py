"""Stores off the critical path: the adapter's prefill returns its logits and its store
runs behind it, on one thread of its own.

A store reads the adapter's staging rows (KV pages) and state slots until it returns, so
whoever writes rows or slots again first waits for the stores still reading them, and
only those (`wait_for`). Stores run in the order they were submitted. On a GPU, a store
starts after an event recorded once the staging copies were queued (so it waits for those
copies and nothing else), runs on a stream of its own, and leaves an event behind that
the next writer's stream waits on, without a host synchronisation.

A store that fails is counted (`failed`) and logged; it leaves no partial entry behind,
since tiercache publishes an entry only once its bytes are in (DESIGN.md invariant 1).
`flush` waits for every store submitted so far; `close` flushes and ends the thread.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Collection

import torch

from tiercache.results import StoreResult
from tiercache.streams import current

log = logging.getLogger("tiercache.integrations")


@dataclass
class _InFlight:
    rows: range  # staging rows the store reads
    slots: frozenset[int]  # state slots the store reads
    future: Future
    done: list = field(default_factory=list)  # the stream event after its GPU work, if any


class StoreQueue:
    """Runs stores one after another on a thread; tracks what each one still reads."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.failed = 0  # stores that raised
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tiercache-store")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._flight: list[_InFlight] = []
        self._lock = threading.Lock()

    def submit(self, store: Callable[[], StoreResult | None], rows: range,
               slots: Collection[int]) -> Future:
        """Run `store` once the GPU work queued so far on the current stream is done; until
        it returns, `rows` and `slots` are its."""
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        flight = _InFlight(rows, frozenset(slots), Future())
        flight.future = self._pool.submit(self._run, store, ready, flight)
        with self._lock:
            self._flight = [f for f in self._flight if not _finished(f)] + [flight]
        return flight.future

    def _run(self, store: Callable[[], StoreResult | None], ready, flight: _InFlight):
        try:
            if self._stream is None:
                return store()
            with current(self._stream):
                self._stream.wait_event(ready)
                result = store()
                flight.done.append(self._stream.record_event())
                return result
        except Exception as error:
            with self._lock:
                self.failed += 1
            log.warning("a background store failed (%d so far), nothing of it half-stored: %s: %s",
                        self.failed, type(error).__name__, error)
            raise

    def wait_for(self, rows: range = range(0), slots: Collection[int] = ()) -> None:
        """Return once no store in flight reads any of `rows` or `slots`; on a GPU the current
        stream also waits for their copies."""
        with self._lock:
            busy = [f for f in self._flight if _overlaps(f, rows, slots)]
        self._settle(busy)

    def flush(self) -> None:
        """Wait for every store submitted so far."""
        with self._lock:
            busy = list(self._flight)
        self._settle(busy)

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)

    def _settle(self, busy: list[_InFlight]) -> None:
        for flight in busy:
            try:
                flight.future.result()
            except Exception:  # counted and logged by _run; the rows are free either way
                pass
            for event in flight.done:
                torch.cuda.current_stream(self.device).wait_event(event)
        with self._lock:
            self._flight = [f for f in self._flight if f not in busy]


def _finished(flight: _InFlight) -> bool:
    return flight.future.done() and all(event.query() for event in flight.done)


def _overlaps(flight: _InFlight, rows: range, slots: Collection[int]) -> bool:
    rows_overlap = len(rows) and len(flight.rows) and (
        rows.start < flight.rows.stop and flight.rows.start < rows.stop)
    return bool(rows_overlap) or not flight.slots.isdisjoint(slots)
