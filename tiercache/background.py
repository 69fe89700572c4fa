"""Work off the request path, and the moves between tiers that the books prepare.

`Mover` does the I/O of those moves, outside the books' lock: a batch of host entries
written to disk in one LMDB transaction, device entries copied down to host slots, disk
entries read into host memory, LMDB records of evicted entries deleted, and whatever an
eviction displaced (`settle`). `Background` is the one thread that takes such work off
the request path: entries to write through or clean ahead of eviction, device entries
to copy down after a store, promotions a match asked for. The engine kicks it after
anything that may have made work; `drain` is the barrier tests and `flush` use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

import numpy as np
import torch

from tiercache.books import Books
from tiercache.room import DiskBatch, Displaced, DownBatch, Leaving
from tiercache.metrics import Traffic
from tiercache.policy import WriteConfig
from tiercache.hashing import PageKey
from tiercache.index import ANY_TIER
from tiercache.results import Kind, Tier
from tiercache.tiers.disk import DiskError, DiskFull, as_array

log = logging.getLogger("tiercache.background")
_DISK_RETRIES = 4  # LMDB may need more room than the budget says: evict more, retry


# a plain int: a Tier flag in the index's numpy masks took ~20 us more a 32k match
_AWAY = ANY_TIER & ~int(Tier.DEVICE)


class Mover:
    """The I/O of moves between tiers; the rows it moves are pinned by the books."""

    def __init__(self, books: Books, traffic: Traffic) -> None:
        self.books = books
        self.traffic = traffic
        self.device_transfer: Any = None  # the device tier's CudaTransfer, once there is one
        # the remote tier's write for entries leaving the node (its write-on-eviction policy):
        # takes (kind, key, depth, bytes, check) entries, returns once they are written
        self.hand_off: Callable[[list], Any] | None = None

    def readable(self, transfer: Any) -> int:
        """The tiers (a mask of Tier values) a worker copying through `transfer` reads: the
        device tier only on its GPU; a worker anywhere else reads device entries from
        their host copies, so until one is copied down, it is a miss for that worker."""
        return ANY_TIER if transfer is self.device_transfer else _AWAY

    def write(self, batch: DiskBatch) -> bool:
        """Write a batch in one transaction. False when LMDB stays full after the retries,
        or the disk refuses writes (the tier counts and logs that)."""
        disk = self.books.disk
        assert disk is not None
        for _ in range(_DISK_RETRIES):
            try:
                with self.traffic.timed("host", "disk", batch.nbytes):
                    disk.write(batch.entries, batch.checks)
                return True
            except DiskError:
                return False
            except DiskFull:  # LMDB's own overhead beyond the budget: make more room, retry
                room = self.books.make_disk_room(max(batch.nbytes, disk.budget_bytes // 10))
                if not room:
                    return False
                self.settle(room)
        return False

    def read(self, kind: Kind, rows: np.ndarray, keys: list[PageKey],
             targets: list[torch.Tensor]) -> list[int]:
        """Copy verified disk entries into `targets`; returns the rows found damaged."""
        disk = self.books.disk
        assert disk is not None, "an entry in no memory tier must be on disk"
        damaged, nbytes = [], 0
        start = time.perf_counter()
        with disk.reader() as reader:
            for row, key, target in zip(rows.tolist(), keys, targets):
                view = reader.get(kind, key)
                if view is None:
                    damaged.append(row)
                else:
                    target.numpy()[:] = as_array(view)
                    nbytes += target.numel() * target.element_size()
        if len(rows):
            self.traffic.record("disk", "host", nbytes, time.perf_counter() - start)
        return damaged

    def copy_down(self, batch: DownBatch) -> None:
        """Copy a batch's device slots into its host slots and wait for it."""
        books, transfer = self.books, self.device_transfer
        nbytes = sum(len(rows) * size for rows, _, size, _ in batch.placed)
        with self.traffic.timed("device", "host", nbytes):
            for _, slots, size, device_slots in batch.placed:
                device_slots = np.asarray(device_slots, np.int64)
                # a host slab at a time: copies of slots that follow one another join
                for part in books.host.pool(size).parts(np.asarray(slots, np.int64)):
                    transfer.copy_entries(list(books.device.pool(size).parts(device_slots[part.positions])),
                                          part.addresses())
            transfer.fence("move").synchronize()

    def delete(self, entries: list[tuple[Kind, PageKey]]) -> None:
        """Delete LMDB records of entries the books have let go; a disk that fails the
        delete leaves records nobody will find (they are overwritten or cleaned at start)."""
        try:
            if entries and self.books.disk is not None:
                self.books.disk.delete(entries)
        except Exception:  # noqa: BLE001 - a failing disk must not fail the call evicting
            log.exception("deleting %d evicted entries from disk failed", len(entries))
        finally:
            self.books.deleted(entries)

    def settle(self, displaced: Displaced) -> int:
        """Do what an eviction displaced: delete, write down, copy down; then let the
        victims go (books.complete_displaced). Returns how many left their tier."""
        if displaced.leaving is not None and self.hand_off is not None:
            self._try(lambda: self.leave(displaced.leaving) or True,
                      "handing evicted entries to the remote tier")
        self.delete(displaced.deletes)
        demoted = copied = False
        try:
            if displaced.demote is not None:
                demoted = self._try(lambda: self.write(displaced.demote), "writing evicted entries")
            if displaced.down is not None:
                copied = self._try(lambda: self.copy_down(displaced.down) or True,
                                   "copying evicted device entries down")
        finally:
            gone = self.books.complete_displaced(displaced, demoted, copied)
        return gone

    def leave(self, leaving: Leaving) -> None:
        """Hand entries leaving the node to the remote tier: from their pinned host slots,
        or from their LMDB records (read before the deletes that follow)."""
        assert self.hand_off is not None
        if len(leaving.rows) or not leaving.entries:
            self.hand_off(leaving.entries)
            return
        disk = self.books.disk
        assert disk is not None
        with disk.reader() as reader:  # the views live as long as the read transaction
            found = [(kind, key, depth, view, check) for (kind, key, depth, _, check), view in
                     ((entry, reader.get(entry[0], entry[1])) for entry in leaving.entries)
                     if view is not None]
            self.hand_off(found)

    @staticmethod
    def _try(move: Callable[[], bool], what: str) -> bool:
        try:
            return move()
        except Exception:  # noqa: BLE001 - a failing disk must not fail the store evicting
            log.exception("%s failed: they are dropped", what)
            return False


class Runner:
    """One thread that calls `step` until it reports no work left, each time it is kicked.
    `drain` is the barrier: it returns once every kick so far has been worked off, and
    re-raises what a step raised meanwhile (the thread lives on)."""

    def __init__(self, step: Callable[[], bool], name: str) -> None:
        self._step = step
        self._name = name
        self._cond = threading.Condition()
        self._kicked = self._busy = self._stopping = False
        self._due: float | None = None  # a kick to come by itself then (time.monotonic)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if not self.running:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def kick(self) -> None:
        """There may be work: run `step` until it finds none."""
        with self._cond:
            self._kicked = True
            self._cond.notify_all()

    def kick_at(self, due: float) -> None:
        """A kick that comes by itself at `due` (time.monotonic), unless one comes first."""
        with self._cond:
            self._due = due if self._due is None else min(self._due, due)
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until the work of every kick so far is done; raise the last step's error.
        Without a thread, do the work here."""
        if not self.running:
            while self._step():
                pass
            return
        with self._cond:
            while self._kicked or self._busy:
                self._cond.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def stop(self) -> None:
        """Finish the work kicked so far, then end the thread and join it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._kicked and not self._stopping:
                    left = None if self._due is None else self._due - time.monotonic()
                    if left is not None and left <= 0:
                        self._kicked, self._due = True, None
                    else:
                        self._cond.wait(left)
                if not self._kicked:
                    return
                self._kicked, self._busy = False, True
            try:
                while self._step():
                    pass
            except BaseException as error:  # kept for drain(): the thread must live on
                log.exception("%s: a background step failed (its work stays undone)", self._name)
                with self._cond:
                    self._error = error
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


# A store's entries are copied down from the device tier this long after it published
# them. The copy down's bookkeeping takes the books' lock and the interpreter for a
# millisecond or more, and the call most likely to come right behind a store is a load
# of the same prefix: a 32k reload from the device right behind its store took 5.2x a
# d2d copy with the copy down at once, 2.9-3.1x deferred 50 ms, as much as an idle
# daemon's (H100, benchmarks/RESULTS.md, twenty-first round). A copy down is not urgent
# for the device tier's own GPU: an eviction from the device copies down whatever has
# no host copy yet, and `drain` (a flush, an eviction from the device tier, the daemon
# stopping) does the deferred ones at once. It is for workers elsewhere (on the CPU, on
# another GPU), which read device entries from their host copies: once one calls, the
# engine has them copied down at once (`copy_down_at_once`).
COPY_DOWN_DELAY = 0.05


class Background:
    """The work off the request path, on one `Runner`: writes to disk, copies down,
    promotions (`promote`, from promotions.py), in the order they were asked for
    (copies down once they are due: COPY_DOWN_DELAY, or at once: `copy_down_at_once`)."""

    def __init__(self, books: Books, mover: Mover, writes: WriteConfig,
                 promote: Callable[[], bool]) -> None:
        self.books, self.mover, self.writes, self._promote = books, mover, writes, promote
        self.runner = Runner(self.step, "tiercache-background")
        self._lock = threading.Lock()
        self._error: BaseException | None = None  # a queued write that failed, for drain()
        self.stopped = False
        # rows to write to disk, oldest first, and markers a durable store waits on
        self._to_write: deque[np.ndarray | threading.Event] = deque()
        # device rows to copy down, oldest first, each after the time it is due at
        self._to_host: deque[tuple[float, np.ndarray]] = deque()
        self.copy_down_delay = COPY_DOWN_DELAY  # 0 once a worker away from the device calls

    @property
    def running(self) -> bool:
        return self.runner.running

    def start(self) -> None:
        """Start the thread once there is work it could do: a disk, or a device tier."""
        if self.books.disk is not None or self.books.device is not None:
            self.runner.start()

    def kick(self) -> None:
        self.runner.kick()

    def drain(self) -> None:
        """Wait until the work asked for so far is done, copies down not yet due too;
        raise what failed meanwhile."""
        self._hurry()
        self.runner.drain()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def stop(self) -> None:
        """Finish the work asked for, end the thread, and wake durable stores waiting (they
        find their rows unwritten)."""
        self._hurry()
        self.runner.stop()
        with self._lock:
            self.stopped = True
            for item in self._to_write:
                if isinstance(item, threading.Event):
                    item.set()

    # -- the work -------------------------------------------------------------------------
    def step(self) -> bool:
        """One promotion, one device-to-host batch or one disk batch; False when there was
        nothing to do (or the disk refused a write: it is tried again at the next kick)."""
        if self.stopped:
            return False
        if self._promote():
            return True
        with self._lock:
            due = self._to_host[0][0] if self._to_host else None
            down = self._to_host.popleft()[1] if due is not None and due <= time.monotonic() else None
        if down is None and due is not None:
            self.runner.kick_at(due)  # the next copy down, when it is due
        if down is not None:
            batch = self.books.begin_copy_down(down)
            if batch is not None:
                copied = Mover._try(lambda: self.mover.copy_down(batch) or True, "a copy down")
                self.books.end_copy_down(batch, copied)
                self.stored(batch.rows)  # now host entries: on towards disk as usual
            return True
        if self.books.disk is None:
            return False
        rows, queued = self._next_writes()
        if not len(rows):
            return queued  # the queue shrank: look again; nothing else would change
        batch, displaced = self.books.begin_write(rows, len(rows))
        self.mover.settle(displaced)
        if batch is None:
            return queued
        written = False
        try:
            written = self.mover.write(batch)
        except Exception as error:  # noqa: BLE001
            if not queued:  # clean-ahead would pick the same rows again: end the round
                raise
            log.exception("writing %d queued entries to disk failed", len(batch.rows))
            with self._lock:
                self._error = error  # for drain(); the queue goes on with the next rows
            return True
        finally:
            self.books.end_write(batch, written)
        return written

    def stored_on_device(self, rows: np.ndarray) -> None:
        """Entries were just published in the device tier: copy them down to the host in the
        background, `copy_down_delay` from now, so that evicting them from the device later
        costs nothing."""
        if len(rows):
            due = time.monotonic() + self.copy_down_delay
            with self._lock:
                self._to_host.append((due, np.asarray(rows, np.int64)))
            self.runner.kick_at(due)

    def copy_down_at_once(self) -> None:
        """From now on, copy each store's entries down as soon as it published them, and
        the deferred ones now: a worker away from the device tier's GPU reads their host
        copies."""
        if self.copy_down_delay:
            self.copy_down_delay = 0.0
            self._hurry()

    def _hurry(self) -> None:
        """Make the copies down not yet due, due now."""
        with self._lock:
            if not self._to_host:
                return
            self._to_host = deque((0.0, rows) for _, rows in self._to_host)
        self.kick()

    def stored(self, rows: np.ndarray) -> None:
        """Entries were just published in the host: write them through, or clean ahead of
        eviction if the host is nearly full."""
        if self.books.disk is None:
            return
        if self.writes.host == "through":
            self.write_soon(rows)
        elif self.books.host.used_bytes >= self.books.host.budget_bytes * (1 - self.writes.clean_ahead):
            self.kick()

    def write_soon(self, rows: np.ndarray) -> None:
        """Queue host entries for the writer."""
        if len(rows):
            with self._lock:
                self._to_write.append(np.asarray(rows, np.int64))
            self.kick()

    def write_and_wait(self, rows: np.ndarray, timeout: float | None) -> bool:
        """Queue host entries for the writer and wait until it has passed them (written,
        or found on disk already, or unable to fit); False if `timeout` came first. The
        writer keeps its order, so no row is written twice."""
        marker = threading.Event()
        with self._lock:
            if self.stopped:
                return True
            if len(rows):
                self._to_write.append(np.asarray(rows, np.int64))
            self._to_write.append(marker)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not marker.is_set():
            # kick again each time: a step that failed (a disk error) ends the thread's
            # round with the marker still queued
            self.kick()
            if not self.running:
                self.drain()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            marker.wait(0.1 if left is None else min(left, 0.1))
        return True

    def _next_writes(self) -> tuple[np.ndarray, bool]:
        """The next rows to write, and whether they came from the queue."""
        limit = self.writes.batch_entries
        with self._lock:
            while self._to_write:
                rows = self._to_write[0]
                if isinstance(rows, threading.Event):  # every row queued before it is done
                    self._to_write.popleft().set()
                    continue
                if len(rows) > limit:
                    self._to_write[0] = rows[limit:]
                else:
                    self._to_write.popleft()
                rows = self.books.dirty(rows[:limit])
                if len(rows):
                    return rows, True
        return self._clean_ahead(limit), False

    def _clean_ahead(self, limit: int) -> np.ndarray:
        """Write-back: the dirty ones among the coldest `clean_ahead` of the host budget,
        once the host is that close to full."""
        host, share = self.books.host, self.writes.clean_ahead
        if self.writes.host != "back" or not share or host.used_bytes < host.budget_bytes * (1 - share):
            return np.empty(0, np.int64)
        return self.books.coldest_dirty(share, limit)
