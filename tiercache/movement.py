"""Bytes moving between tiers and into workers: loads, promotions and disk writes.

- Loads: `deliver` brings pinned entries into host memory (a disk hit is promoted to the
  host on the way, or read into a staging buffer when the host has no room) and scatters
  them into the worker's rows. An asynchronous (GPU) load keeps its entries pinned until
  the event its copies end with completes (`reap`).
- Promotions: a match may ask for its disk hits to move up ahead of the load
  (`start_promotion`); the background thread reads them into host slots nobody can see
  and publishes them once the copy is complete. Every entry being promoted, by that
  thread or by a load, belongs to a `Move` until it is published: a load waits for the
  moves of the entries it needs, and reads an entry someone else started moving since
  from disk itself, so no entry is promoted twice and no slot is read before its bytes
  are whole.
- Writes: host entries go to disk in batches, one LMDB transaction each, on the
  background thread: right after their store (write-through), or, for write-back, the
  coldest `clean_ahead` share of the host budget once the host fills past the rest, so
  that evictions find their victims on disk already. A victim the writer has not reached
  (a store needing more room than is kept clean, or write-back with nothing kept clean)
  is written by the eviction itself, synchronously (`Tiering.demote`): never lost.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiercache import failpoints
from tiercache.background import Background
from tiercache.index import Index
from tiercache.results import Kind, Tier
from tiercache.policy import WriteConfig
from tiercache.tiering import Tiering
from tiercache.tiers.arena import SlabPart
from tiercache.transfer import CpuTransfer, CudaTransfer

Transfer = CpuTransfer | CudaTransfer


@dataclass
class Group:
    """One kind of entry moving between the worker and the tiers."""

    kind: Kind
    buffers: tuple[torch.Tensor, ...]
    offsets: list[int]
    nbytes: int
    transfer: Transfer  # the copy path of the worker's device


@dataclass(eq=False)  # identity: `_moves.remove` must not compare the row arrays
class Move:
    """Disk entries on their way into host slots that nobody can see yet."""

    rows: np.ndarray
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class Delivery:
    bytes_from: dict[Tier, int]
    damaged: int
    promoted: int
    event: Any = None  # asynchronous loads: the event that marks the copies done


class Movement:
    def __init__(self, tiers: Tiering, transfer: CpuTransfer, writes: WriteConfig,
                 lock: threading.RLock, counters: dict[str, int]) -> None:
        self.tiers = tiers
        self.index: Index = tiers.index
        self.host = tiers.host
        self.transfer = transfer
        self.writes = writes
        self.lock = lock
        self.counters = counters
        self.background = Background(self.step, "tiercache-background")
        self._moves: list[Move] = []  # every promotion in flight
        self._queued: deque[Move] = deque()  # promotions waiting for the background thread
        # rows to write to disk, oldest first, and markers a durable store waits on
        self._to_write: deque[np.ndarray | threading.Event] = deque()
        self._to_host: deque[np.ndarray] = deque()  # device rows to copy down, oldest first
        self._pending: list[tuple[Any, np.ndarray, list[torch.Tensor]]] = []  # async loads
        # the last interprocess events handed out: a worker may open one after its copy is
        # done, and an exported event must still exist then
        self._handed_out: deque = deque(maxlen=1024)
        self.stopped = False

    # -- the background thread ------------------------------------------------------------
    def start(self) -> None:
        """Start the thread once there is work it could do: a disk, or a device tier."""
        if not self.background.running and (self.tiers.disk is not None or self.tiers.device):
            self.background.start()

    def drain(self) -> None:
        """Return when every write and promotion asked for so far is done."""
        if self.background.running:
            self.background.drain()
        else:  # never started (an engine built by hand): do the work here
            while self.step():
                pass

    def stop(self) -> None:
        """Finish what was asked, end the thread, and give up promotions still queued."""
        self.background.stop()
        with self.lock:
            self.stopped = True
            while self._queued:
                self._finish(self._queued.popleft(), [])
            for item in self._to_write:  # wake durable stores: they find their rows unwritten
                if isinstance(item, threading.Event):
                    item.set()

    def step(self) -> bool:
        """One promotion, one device-to-host batch or one disk batch; False when there was
        nothing to do."""
        rows, queued, batch = np.empty(0, np.int64), False, None
        with self.lock:
            if self.stopped:
                return False
            move = self._queued.popleft() if self._queued else None
            down = self.tiers.begin_copy_down(self._to_host.popleft()) if (
                move is None and self._to_host) else None
            if move is None and down is None and self._to_host:
                return True  # that batch needed no copy: look at the next
            if move is None and down is None:
                rows, queued = self._next_writes()
                batch = self.tiers.begin_write(rows, len(rows)) if len(rows) else None
        if move is not None:
            self._promote(move)
            return True
        if down is not None:
            copied = False
            try:
                self.tiers.copy(down)
                copied = True
            finally:
                with self.lock:
                    self.counters["copied_down"] += self.tiers.end_copy_down(down, copied)
                    self.stored(down.rows)  # now host entries: on towards disk as usual
            return True
        if batch is None:
            return queued  # the queue shrank: look again; nothing else would change
        written = False
        try:
            written = self.tiers.write(batch)
        finally:
            with self.lock:
                self.counters["disk_writes"] += self.tiers.end_write(batch, written)
        return written  # a disk that refused it is tried again at the next kick, not now

    # -- writes -----------------------------------------------------------------------------
    def stored_on_device(self, rows: np.ndarray) -> None:
        """Entries were just published in the device tier: copy them down to the host in the
        background, so that evicting them from the device later costs nothing."""
        if len(rows):
            self._to_host.append(np.asarray(rows, np.int64))
            self.background.kick()

    def stored(self, rows: np.ndarray) -> None:
        """Entries were just published in the host: write them through, or clean ahead of
        eviction if the host is nearly full. Call under the lock."""
        if self.tiers.disk is None:
            return
        if self.writes.host == "through":
            self.write_soon(rows)
        elif self.host.used_bytes >= self.host.budget_bytes * (1 - self.writes.clean_ahead):
            self.background.kick()

    def write_and_wait(self, rows: np.ndarray, timeout: float | None) -> bool:
        """Queue host entries for the writer and wait until it has passed them (written,
        or found on disk already, or unable to fit); False if `timeout` came first. The
        writer keeps its order, so no row is written twice. Call without the lock."""
        marker = threading.Event()
        with self.lock:
            if self.stopped:
                return True
            if len(rows):
                self._to_write.append(np.asarray(rows, np.int64))
            self._to_write.append(marker)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not marker.is_set():
            # kick again each time: a step that failed (a disk error) ends the thread's
            # round with the marker still queued
            self.background.kick()
            if not self.background.running:
                self.drain()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            marker.wait(0.1 if left is None else min(left, 0.1))
        return True

    def write_soon(self, rows: np.ndarray) -> None:
        """Queue host entries for the background writer. Call under the lock."""
        if len(rows):
            self._to_write.append(np.asarray(rows, np.int64))
            self.background.kick()

    def _next_writes(self) -> tuple[np.ndarray, bool]:
        """The next rows to write, and whether they came from the queue."""
        limit = self.writes.batch_entries
        while self._to_write:
            rows = self._to_write[0]
            if isinstance(rows, threading.Event):  # every row queued before it is done
                self._to_write.popleft().set()
                continue
            if len(rows) > limit:
                self._to_write[0] = rows[limit:]
            else:
                self._to_write.popleft()
            rows = self.tiers.dirty(rows[:limit])
            if len(rows):
                return rows, True
        return self._clean_ahead(limit), False

    def _clean_ahead(self, limit: int) -> np.ndarray:
        """Write-back: the dirty ones among the coldest `clean_ahead` of the host budget,
        once the host is that close to full."""
        ahead = self.host.budget_bytes * self.writes.clean_ahead
        far = self.host.used_bytes < self.host.budget_bytes - ahead
        if self.writes.host != "back" or not ahead or far:
            return np.empty(0, np.int64)
        candidates = self.index.candidates(Tier.HOST)
        order = self.tiers.policy.order(candidates)
        sizes = np.cumsum(candidates.nbytes[order])
        coldest = candidates.rows[order][:int(np.searchsorted(sizes, ahead)) + 1]
        return self.tiers.dirty(coldest)[:limit]

    # -- promotions -------------------------------------------------------------------------
    def moving(self, rows: np.ndarray) -> np.ndarray:
        """Which of `rows` a promotion in flight owns. Call under the lock."""
        if not self._moves:
            return np.zeros(len(rows), bool)
        return np.isin(rows, np.concatenate([m.rows for m in self._moves]))

    def await_moves(self, rows: np.ndarray) -> None:
        """Wait (without the lock) until no promotion in flight owns any of `rows`."""
        while True:
            with self.lock:
                pending = [m for m in self._moves if np.isin(m.rows, rows).any()]
                self.counters["promotion_waits"] += bool(pending)
            if not pending:
                return
            for move in pending:
                move.done.wait()

    def start_promotion(self, rows: np.ndarray) -> int:
        """Queue the disk-only entries among `rows` (none of them being moved already) for
        promotion to the host; returns how many. Call under the lock."""
        if not self.background.running or self.stopped:
            return 0
        rows = rows[~self.index.in_tier(rows, Tier.HOST)]
        rows = rows[~self.moving(rows)]
        if not len(rows):
            return 0
        self.index.pin(rows)  # pinned while read: the disk copy stays until it is done
        move = Move(rows)
        self._moves.append(move)
        self._queued.append(move)
        self.background.kick()
        return len(rows)

    def _promote(self, move: Move) -> None:
        """Read a move's entries from disk into new host slots, then publish them."""
        placed: list[tuple[np.ndarray, list[int], int, list[int] | None]] = []
        try:
            kinds, sizes = self.index.column("kind", move.rows), self.index.column("nbytes", move.rows)
            for kind, nbytes in sorted(set(zip(kinds.tolist(), sizes.tolist()))):
                rows = move.rows[(kinds == kind) & (sizes == nbytes)]
                with self.lock:
                    slots = self.tiers.reserve(nbytes, len(rows))
                placed.append((rows[:len(slots)], slots, nbytes, None))
                pool = self.host.pool(nbytes)
                bad = self.tiers.read_disk(Kind(kind), rows[:len(slots)], [pool.view(s) for s in slots])
                placed[-1] = (rows[:len(slots)], slots, nbytes, bad)
        finally:
            with self.lock:
                self._finish(move, placed)

    def _finish(self, move: Move, placed: list) -> None:
        """Publish what a move copied whole, give back the rest, wake its waiters."""
        self.index.unpin(move.rows)
        damaged: list[int] = []
        for rows, slots, nbytes, bad in placed:
            good = np.ones(len(rows), bool) if bad is not None else np.zeros(len(rows), bool)
            good &= ~np.isin(rows, bad or [])
            slots = np.asarray(slots, np.int64)
            self.host.free(nbytes, slots[~good].tolist())
            self.index.add_tier(rows[good], Tier.HOST, slots[good])
            self.counters["promoted"] += int(good.sum())
            damaged += bad or []
        self.tiers.drop(np.asarray(damaged, np.int64))
        self._moves.remove(move)
        move.done.set()

    # -- loads ------------------------------------------------------------------------------
    def reap(self) -> None:
        """Unpin the entries of asynchronous loads whose copies have finished. Call under
        the lock."""
        if self._pending:
            waiting = []
            for event, rows, staging in self._pending:
                if event.query():
                    self.index.unpin(rows)
                else:
                    waiting.append((event, rows, staging))
            self._pending = waiting

    def deliver(self, pinned: np.ndarray, moves: list[tuple[Group, np.ndarray, np.ndarray | None]],
                transfer: Transfer, asynchronous: bool = False) -> Delivery:
        """Bring pinned entries into host memory (promoting disk hits) and, where a move
        names destination rows, scatter them into the worker. `pinned` is unpinned when
        the copies are done: now, or, for an asynchronous load, once its event completes."""
        done = Delivery({}, 0, 0)
        complete = False  # promotions are published only if every copy got through
        damaged: list[int] = []
        promoted: list[tuple[Move, list[int], int]] = []  # (move, host slots, nbytes)
        staging: list[torch.Tensor] = []  # must outlive the copies that read it
        copying = 0.0  # seconds spent scattering into the worker, disk reads left out
        try:
            self.await_moves(pinned)
            for group, entry_rows, dst in moves:
                staged = self._stage(group, entry_rows, dst is not None, damaged, promoted)
                if staged is None or dst is None:
                    continue
                staging.append(staged[2])
                failpoints.hit("load.before_scatter")
                copying += self._scatter(transfer, group, staged, dst, done)
            self._fence(transfer, done, asynchronous, copying)
            complete = True
        except BaseException:
            transfer.synchronize()  # nothing may still read entries we are about to unpin
            raise
        finally:
            with self.lock:
                self._settle(done, pinned, staging, promoted, damaged, asynchronous, complete)
        done.damaged = len(damaged)
        if not asynchronous:
            done.event = None
        return done

    def _scatter(self, transfer: Transfer, group: Group,
                 staged: tuple[list[SlabPart], dict[Tier, int], Any], dst: np.ndarray,
                 done: Delivery) -> float:
        """Copy staged entries into the worker's rows, counting the bytes by the tier they
        came from; returns the seconds the call took."""
        parts, counts, _ = staged
        start = time.perf_counter()
        transfer.scatter(parts, group.buffers, group.offsets, dst)
        for tier, count in counts.items():
            if count:
                done.bytes_from[tier] = done.bytes_from.get(tier, 0) + count * group.nbytes
        return time.perf_counter() - start

    def _fence(self, transfer: Transfer, done: Delivery, asynchronous: bool, copying: float) -> None:
        """End a delivery's copies: wait for them, or hand back the event that marks them
        done, and count the bytes by hop: device entries reach the worker from the device,
        the rest from host memory (a host slot, or staging for a disk entry)."""
        start = time.perf_counter()
        done.event = transfer.fence("load", interprocess=asynchronous)
        if not asynchronous:
            done.event.synchronize()
        seconds = None if asynchronous else copying + time.perf_counter() - start
        from_device = done.bytes_from.get(Tier.DEVICE, 0)
        from_host = sum(done.bytes_from.values()) - from_device
        # one copy read both: its time belongs to neither hop alone, so it is not timed
        if from_device and from_host:
            seconds = None
        for source, nbytes in (("device", from_device), ("host", from_host)):
            if nbytes:
                self.tiers.traffic.record(source, "worker", nbytes, seconds)

    def _settle(self, done: Delivery, pinned: np.ndarray, staging: list[torch.Tensor],
                promoted: list[tuple[Move, list[int], int]], damaged: list[int],
                asynchronous: bool, complete: bool) -> None:
        """After a delivery (under the lock): unpin or leave pinned for the copies still
        running, publish the promotions (none if an entry was damaged or the delivery
        failed part way: their slots may hold part of their bytes), drop the damaged."""
        if done.event is not None and asynchronous and complete and not damaged:
            self._pending.append((done.event, pinned, staging))
            self._handed_out.append(done.event)
        else:
            self.index.unpin(pinned)
        for move, slots, nbytes in promoted:
            if damaged or not complete:
                self.host.free(nbytes, slots)
            else:
                self.index.add_tier(move.rows, Tier.HOST, slots)
                done.promoted += len(move.rows)
            self._moves.remove(move)
            move.done.set()
        self.counters["promoted"] += done.promoted
        self.tiers.drop(np.asarray(damaged, np.int64))

    def _stage(self, group: Group, entry_rows: np.ndarray, staging_ok: bool, damaged: list[int],
               promoted: list[tuple[Move, list[int], int]]
               ) -> tuple[list[SlabPart], dict[Tier, int], torch.Tensor] | None:
        """Host memory holding the pinned `entry_rows`: their host slots, where disk entries
        are first read into new host slots (promotion) or, when the host has no room or
        another promotion owns them and `staging_ok`, into a staging buffer (page-locked
        for a GPU); entries in the device tier are read from there by workers on its GPU.
        Returns (parts, entries per tier they come from, the staging buffer), or None when a
        disk entry turned out damaged."""
        nbytes = group.nbytes
        with self.lock:
            # device copies serve workers on the device tier's GPU (device to device)
            on_device = self.index.in_tier(entry_rows, Tier.DEVICE) if (
                group.transfer is self.tiers.device_transfer) else np.zeros(len(entry_rows), bool)
            device_slots = self.index.slots(entry_rows[on_device], Tier.DEVICE)
            in_host = self.index.in_tier(entry_rows, Tier.HOST) & ~on_device
            slots = np.where(in_host, self.index.slots(entry_rows, Tier.HOST), -1)
            from_disk = np.flatnonzero(~in_host & ~on_device)
            owned = self.moving(entry_rows[from_disk])
            promo = self.tiers.reserve(nbytes, int((~owned).sum())) if len(from_disk) else []
            # the entries this load promotes first, then the ones it only stages
            from_disk = np.concatenate([from_disk[~owned], from_disk[owned]])
            if promo:
                move = Move(entry_rows[from_disk[:len(promo)]])
                self._moves.append(move)
                promoted.append((move, promo, nbytes))
        if not staging_ok:
            from_disk = from_disk[:len(promo)]
        pool = self.host.pool(nbytes)
        staging = torch.empty((len(from_disk) - len(promo), nbytes), dtype=torch.uint8,
                              pin_memory=group.transfer.device.type == "cuda")
        if len(from_disk):
            bad = self.tiers.read_disk(group.kind, entry_rows[from_disk],
                                       [pool.view(s) for s in promo] + list(staging))
            if bad:
                damaged.extend(bad)
                return None
            slots[from_disk[:len(promo)]] = promo
        at = np.flatnonzero(slots >= 0)
        parts = [SlabPart(p.slab, p.local, at[p.positions]) for p in pool.parts(slots[at])]
        if len(device_slots):
            at = np.flatnonzero(on_device)
            parts += [SlabPart(p.slab, p.local, at[p.positions])
                      for p in self.tiers.device.pool(nbytes).parts(device_slots)]
        if len(staging):
            parts.append(SlabPart(staging, np.arange(len(staging)), from_disk[len(promo):]))
        counts = {Tier.DEVICE: len(device_slots), Tier.DISK: len(from_disk),
                  Tier.HOST: len(entry_rows) - len(device_slots) - len(from_disk)}
        return parts, counts, staging
