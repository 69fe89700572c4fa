"""Disk entries on their way up into host slots: one registry of the moves in flight.

A match may ask for its disk hits to move up ahead of the load (`start`: the background
thread runs it, `run_one`); a load promotes the disk entries it reads itself (`claim`).
Every entry being promoted belongs to one `Move` until `finish` publishes it: a load waits
for the moves of the entries it needs (`await_moves`), and reads an entry someone else is
moving from disk itself, so no entry is promoted twice and no slot is read before its
bytes are whole (invariant 1). Host slots for promotions are taken only where no entry
must move first (`Books.reserve_clean`): a promotion never waits on a disk write.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tiercache.background import Mover
from tiercache.books import Books
from tiercache.results import Kind


@dataclass(eq=False)  # identity: `_moves.remove` must not compare the row arrays
class Move:
    """Disk entries on their way into host slots that nobody can see yet."""

    rows: np.ndarray
    pinned: bool  # its own pins (a background promotion); a load's moves ride on the load's
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Located:
    """Where a load's entries are (see `Promotions.locate`)."""

    on_device: np.ndarray  # bool per entry
    device_slots: np.ndarray  # of the entries on the device
    host_slots: np.ndarray  # per entry, -1 where not in the host
    from_disk: np.ndarray  # positions of the entries to read from disk, promoted ones first
    move: Move | None  # the load's own move of the first len(promo) of them
    promo: list[int]  # their host slots


@dataclass
class Placed:
    """Entries of one kind and size of a move, and the host slots they are read into;
    `bad` lists the damaged ones once the read is done (None: it never finished)."""

    rows: np.ndarray
    slots: list[int]
    nbytes: int
    bad: list[int] | None = None


class Promotions:
    def __init__(self, books: Books, mover: Mover) -> None:
        self.books = books
        self.mover = mover
        self._lock = threading.Lock()
        self._moves: list[Move] = []  # every promotion in flight
        self._queued: deque[Move] = deque()  # those waiting for the background thread
        self.accepting = False  # background promotions need the thread: the engine says when

    def _owned(self, rows: np.ndarray) -> np.ndarray:
        if not self._moves:
            return np.zeros(len(rows), bool)
        return np.isin(rows, np.concatenate([m.rows for m in self._moves]))

    def start(self, rows: np.ndarray) -> int:
        """Queue the disk-only entries among `rows` (none of them being moved already)
        for the background thread; returns how many."""
        with self._lock:
            if not self.accepting:
                return 0
            rows = self.books.disk_only(rows)
            rows = rows[~self._owned(rows)]
            if not len(rows):
                return 0
            self.books.pin(rows)  # pinned while read: the disk copy stays until it is done
            move = Move(rows, pinned=True)
            self._moves.append(move)
            self._queued.append(move)
            return len(rows)

    def locate(self, rows: np.ndarray, nbytes: int, device_ok: bool) -> Located:
        """Where a load finds pinned entries: on the device (if its worker is on the device
        tier's GPU), in host slots, or on disk; the disk ones that no move owns get host
        slots where there is room and a move of this load's (it publishes them when its
        copies are done), the others are staged. One decision under the registry's lock:
        no move can start or end half way through it."""
        with self._lock:
            on_device, device_slots, host_slots, from_disk = self.books.locate(rows, device_ok)
            if not len(from_disk):  # the usual case: every entry in memory
                return Located(on_device, device_slots, host_slots, from_disk, None, [])
            owned = self._owned(rows[from_disk])
            promo = self.books.reserve_clean(nbytes, int((~owned).sum())) if (~owned).any() else []
            # the entries this load promotes first, then the ones it only stages
            from_disk = np.concatenate([from_disk[~owned], from_disk[owned]])
            move = None
            if promo:
                move = Move(rows[from_disk[:len(promo)]], pinned=False)
                self._moves.append(move)
            return Located(on_device, device_slots, host_slots, from_disk, move, promo)

    def await_moves(self, rows: np.ndarray) -> None:
        """Wait until no promotion in flight owns any of `rows`."""
        while True:
            with self._lock:
                pending = [m for m in self._moves if np.isin(m.rows, rows).any()]
            if not pending:
                return
            self.books.count("promotion_waits", 1)
            for move in pending:
                move.done.wait()

    def run_one(self) -> bool:
        """Promote the oldest queued move (the background thread); False if none."""
        with self._lock:
            move = self._queued.popleft() if self._queued else None
        if move is None:
            return False
        placed: list[Placed] = []
        try:
            kinds, sizes = self.books.columns(move.rows, "kind", "nbytes")
            for kind, nbytes in sorted(set(zip(kinds.tolist(), sizes.tolist()))):
                rows = move.rows[(kinds == kind) & (sizes == nbytes)]
                slots = self.books.reserve_clean(nbytes, len(rows))
                placed.append(Placed(rows[:len(slots)], slots, nbytes))
                pool = self.books.host.pool(nbytes)
                placed[-1].bad = self.mover.read(Kind(kind), placed[-1].rows,
                                                 self.books.keys(placed[-1].rows),
                                                 [pool.view(s) for s in slots])
        finally:
            self.finish(move, placed, complete=True)
        return True

    def finish(self, move: Move, placed: list[Placed], complete: bool) -> int:
        """Publish what a move copied whole (if `complete`), give back the rest, drop the
        damaged, wake its waiters; returns how many entries it published."""
        published = self.books.settle_promotion(move.rows if move.pinned else None,
                                                [(p.rows, p.slots, p.nbytes, p.bad) for p in placed],
                                                complete)
        damaged = [r for p in placed for r in (p.bad or [])]
        if damaged:
            self.mover.settle(self.books.drop(np.asarray(damaged, np.int64)))
        with self._lock:
            self._moves.remove(move)
            move.done.set()
        return published

    def stop(self) -> None:
        """Give up promotions still queued (the thread has ended)."""
        with self._lock:
            self.accepting = False
            queued, self._queued = list(self._queued), deque()
        for move in queued:
            self.finish(move, [], complete=False)
