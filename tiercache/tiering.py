"""Room and movement between tiers: reserving host slots by evicting cold entries, writing
host entries to disk (in batches, by the background writer, or synchronously for an
evicted entry the writer has not reached), reading verified disk entries, and removing
entries from a tier.

Not thread-safe: the engine calls it under its lock (`lock`, shared), except `read_disk`
and `write`, which touch pinned entries only and take the lock to make room.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiercache.hashing import key_list
from tiercache.index import Index
from tiercache.results import Kind, Tier
from tiercache.metrics import Traffic
from tiercache.policy import EvictionPolicy, FlopAware
from tiercache.tiers.arena import SlotArena
from tiercache.tiers.disk import DiskError, DiskFull, DiskTier, as_array
from tiercache.tuning import AlphaTuner

log = logging.getLogger("tiercache.tiering")
_DISK_RETRIES = 4  # LMDB may need more room than the budget says: evict more, retry


@dataclass(frozen=True)
class DiskBatch:
    """Host entries on their way to disk: pinned, so their slots stay as they are."""

    rows: np.ndarray
    entries: list  # (kind, key, depth, bytes) as DiskTier.write takes them
    nbytes: int
    checks: list  # of each entry (Index.verified)


@dataclass(frozen=True)
class DownBatch:
    """Device entries on their way to host slots: (rows, host slots, entry size) groups."""

    rows: np.ndarray
    placed: list


class Tiering:
    def __init__(self, index: Index, host: SlotArena, disk: DiskTier | None,
                 policy: EvictionPolicy, counters: dict[str, int], evict_slack: float,
                 lock: threading.RLock, tuner: AlphaTuner | None = None,
                 traffic: Traffic | None = None) -> None:
        self.index = index
        self.host = host
        self.disk = disk
        self.policy = policy
        self.counters = counters
        self.evict_slack = evict_slack
        self.lock = lock
        self.tuner = tuner
        self.traffic = traffic or Traffic()
        self.writing_bytes = 0  # disk room promised to batches being written
        self.device: SlotArena | None = None  # the GPU arena, once a GPU worker brings one
        self.device_transfer: Any = None  # that GPU's CudaTransfer

    def arena(self, tier: Tier) -> SlotArena:
        arena = self.device if tier == Tier.DEVICE else self.host
        assert arena is not None, f"no {tier.name} arena"
        return arena

    def read_disk(self, kind: Kind, rows: np.ndarray, targets: list[torch.Tensor]) -> list[int]:
        """Copy verified disk entries into `targets`; returns the rows found damaged."""
        assert self.disk is not None, "an entry in no memory tier must be on disk"
        damaged, nbytes = [], 0
        start = time.perf_counter()
        with self.disk.reader() as reader:
            for row, key, target in zip(rows.tolist(), key_list(self.index.keys(rows)), targets):
                view = reader.get(kind, key)
                if view is None:
                    damaged.append(row)
                else:
                    target.numpy()[:] = as_array(view)
                    nbytes += target.numel() * target.element_size()
        if len(rows):
            self.traffic.record("disk", "host", nbytes, time.perf_counter() - start)
        return damaged

    def reserve(self, nbytes: int, count: int, tier: Tier = Tier.HOST) -> list[int]:
        """Up to `count` slots of `nbytes` in an arena tier, evicting (and demoting) cold
        entries for room."""
        arena = self.arena(tier)
        slots = arena.alloc(nbytes, count)
        while len(slots) < count and arena.fits(nbytes):
            want = max((count - len(slots)) * nbytes, int(arena.budget_bytes * self.evict_slack))
            if not self.evict(tier, want):
                break
            slots += arena.alloc(nbytes, count - len(slots))
        return slots

    def evict(self, tier: Tier, want_bytes: int) -> int:
        """Free about `want_bytes` of `tier` in the policy's order; host entries that are not
        on disk yet are written there first. Returns the bytes freed."""
        candidates = self.index.candidates(tier)
        order = self.policy.order(candidates)
        sizes = np.cumsum(candidates.nbytes[order])
        chosen = order[:int(np.searchsorted(sizes, want_bytes)) + 1]
        victims = candidates.rows[chosen]
        if not len(victims):
            return 0
        if tier == Tier.HOST and self.tuner is not None:
            self.tuner.evicted(candidates, chosen, self.index.keys(victims))
        if tier == Tier.HOST and self.disk is not None:
            self.counters["demoted"] += self.demote(victims)
        if tier == Tier.DEVICE:  # the background copy down has not reached these yet
            self.counters["copied_down"] += self.copy_down(victims)
        self.remove(victims, tier)
        self.counters["evicted_" + tier.name.lower()] += len(victims)
        return int(sizes[len(victims) - 1])

    def returned(self, kind: Kind, keys: np.ndarray) -> None:
        """Entries are being stored anew: let the tuner learn from evictions it regrets."""
        if self.tuner is not None and self.tuner.returned(kind, keys):
            self.policy = FlopAware(self.tuner.alpha)

    def remove(self, rows: np.ndarray, tier: Tier) -> None:
        """Take unpinned entries out of one tier and give back their room."""
        if tier in (Tier.HOST, Tier.DEVICE):
            arena = self.arena(tier)
            slots, sizes = self.index.slots(rows, tier), self.index.column("nbytes", rows)
            for size in np.unique(sizes).tolist():
                arena.free(size, slots[sizes == size].tolist())
        elif tier == Tier.DISK:
            assert self.disk is not None
            kinds = self.index.column("kind", rows).tolist()
            self.disk.delete([(Kind(k), key) for k, key in zip(kinds, key_list(self.index.keys(rows)))])
        self.index.unpublish(rows, tier)

    def dirty(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Of `rows` (every row if None), those in the host and not on disk yet."""
        rows = self.index.rows_in(Tier.HOST) if rows is None else rows
        return rows[self.index.in_tier(rows, Tier.HOST) & ~self.index.in_tier(rows, Tier.DISK)]

    def demote(self, rows: np.ndarray) -> int:
        """Write host entries not on disk yet to disk now, in one transaction, under the
        engine lock: the fallback for victims the background writer has not reached.
        Returns how many were written (0 when they cannot fit the disk tier, or the write
        failed: the victims are dropped all the same, as a cache may)."""
        batch = self.begin_write(rows, limit=len(rows))
        if batch is None:
            return 0
        written = False
        try:
            written = self.write(batch)
        except Exception:  # noqa: BLE001 - a failing disk must not fail the store evicting
            log.exception("writing %d evicted entries to disk failed: they are dropped", len(rows))
        finally:
            done = self.end_write(batch, written)  # unpins: no leak whatever happened
        return done

    def begin_write(self, rows: np.ndarray, limit: int) -> DiskBatch | None:
        """Pin up to `limit` of the dirty `rows`, make room for them on disk, and take what a
        disk write needs; None if there is nothing to write or it cannot fit."""
        assert self.disk is not None
        index = self.index
        rows = self.dirty(np.unique(rows))[:limit]
        sizes = index.column("nbytes", rows)
        total = int(sizes.sum())
        if not len(rows) or total > self.disk.budget_bytes:
            return None
        entries = [(Kind(kind), key, depth, self.host.pool(size).view(slot).numpy())
                   for kind, key, depth, size, slot in zip(
                       index.column("kind", rows).tolist(), key_list(index.keys(rows)),
                       index.column("depth", rows).tolist(), sizes.tolist(),
                       index.slots(rows, Tier.HOST).tolist())]
        index.pin(rows)  # pinned while read, and no candidate for the disk evictions below
        over = self.disk.used_bytes + self.writing_bytes + total - self.disk.budget_bytes
        if over > 0:
            self.evict(Tier.DISK, over)
        self.writing_bytes += total
        return DiskBatch(rows, entries, total, index.column("check", rows).tolist())

    def write(self, batch: DiskBatch) -> bool:
        """Write a batch in one transaction (no engine lock needed: its rows are pinned).
        False when LMDB stays full after the retries, or the disk refuses writes (the
        tier counts and logs that)."""
        assert self.disk is not None
        for _ in range(_DISK_RETRIES):
            try:
                with self.traffic.timed("host", "disk", batch.nbytes):
                    self.disk.write(batch.entries, batch.checks)
                return True
            except DiskError:
                return False
            except DiskFull:  # LMDB's own overhead beyond the budget: make more room, retry
                with self.lock:
                    if not self.evict(Tier.DISK, max(batch.nbytes, self.disk.budget_bytes // 10)):
                        return False
        return False

    def end_write(self, batch: DiskBatch, written: bool) -> int:
        """Publish a written batch in the disk tier (after its commit) and unpin it."""
        self.writing_bytes -= batch.nbytes
        self.index.unpin(batch.rows)
        if not written:
            return 0
        self.index.add_tier(batch.rows, Tier.DISK)
        return len(batch.rows)

    def drop(self, rows: np.ndarray) -> None:
        """Remove damaged entries from every tier. One a load is still reading stays:
        that load finds out for itself and drops it when it ends."""
        rows = rows[self.index.column("pins", rows) == 0]
        for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
            inside = rows[self.index.in_tier(rows, tier)]
            if len(inside):
                self.remove(inside, tier)
                self.counters[f"evicted_{tier.name.lower()}_damaged"] += len(inside)

    # -- device -> host ---------------------------------------------------------------------
    def begin_copy_down(self, rows: np.ndarray) -> DownBatch | None:
        """Pin the device entries among `rows` that have no host copy and reserve host
        slots for them; None if there is nothing to copy or no room."""
        rows = np.unique(rows)
        rows = rows[self.index.in_tier(rows, Tier.DEVICE) & ~self.index.in_tier(rows, Tier.HOST)]
        if not len(rows):
            return None
        self.index.pin(rows)  # pinned while read, and no candidate for the evictions below
        placed, sizes = [], self.index.column("nbytes", rows)
        for size in np.unique(sizes).tolist():
            group = rows[sizes == size]
            slots = self.reserve(size, len(group))
            placed.append((group[:len(slots)], np.asarray(slots, np.int64), size))
        return DownBatch(rows, placed)

    def copy(self, batch: DownBatch) -> None:
        """Copy a batch's device slots into its host slots and wait for it (no lock needed:
        the rows are pinned and the host slots are nobody else's)."""
        nbytes = sum(len(rows) * size for rows, _, size in batch.placed)
        with self.traffic.timed("device", "host", nbytes):
            for rows, slots, size in batch.placed:
                pool = self.host.pool(size)
                addresses = np.array([pool.view(s).data_ptr() for s in slots.tolist()], np.int64)
                self.device_transfer.copy_entries(
                    list(self.device.pool(size).parts(self.index.slots(rows, Tier.DEVICE))),
                    addresses)
            self.device_transfer.fence("move").synchronize()

    def end_copy_down(self, batch: DownBatch, copied: bool) -> int:
        """Publish the copies in the host (after they are complete) and unpin."""
        self.index.unpin(batch.rows)
        done = 0
        for rows, slots, size in batch.placed:
            if copied:
                self.index.add_tier(rows, Tier.HOST, slots)
                done += len(rows)
            else:
                self.host.free(size, slots.tolist())
        return done

    def copy_down(self, rows: np.ndarray) -> int:
        """Copy device entries to the host now (the eviction fallback, under the lock)."""
        batch = self.begin_copy_down(rows)
        if batch is None:
            return 0
        copied = False
        try:
            self.copy(batch)
            copied = True
        finally:
            done = self.end_copy_down(batch, copied)
        return done
