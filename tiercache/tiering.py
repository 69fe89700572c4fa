"""Room and movement between tiers: reserving host slots by evicting cold entries,
demoting host entries to disk before their slots are reused, reading verified disk
entries, and removing entries from a tier.

Not thread-safe: the engine calls it under its lock, except `read_disk`, which reads
pinned entries only.
"""

from __future__ import annotations

import numpy as np
import torch

from tiercache.hashing import key_list
from tiercache.index import Index, Kind, Tier
from tiercache.policy import EvictionPolicy
from tiercache.tiers.arena import SlotArena
from tiercache.tiers.disk import DiskFull, DiskTier, as_array

_DISK_RETRIES = 4  # LMDB may need more room than the budget says: evict more, retry


class Tiering:
    def __init__(self, index: Index, host: SlotArena, disk: DiskTier | None,
                 policy: EvictionPolicy, counters: dict[str, int], evict_slack: float) -> None:
        self.index = index
        self.host = host
        self.disk = disk
        self.policy = policy
        self.counters = counters
        self.evict_slack = evict_slack

    def read_disk(self, kind: Kind, rows: np.ndarray, targets: list[torch.Tensor]) -> list[int]:
        """Copy verified disk entries into `targets`; returns the rows found damaged."""
        assert self.disk is not None, "an entry in no memory tier must be on disk"
        damaged = []
        with self.disk.reader() as reader:
            for row, key, target in zip(rows.tolist(), key_list(self.index.keys(rows)), targets):
                view = reader.get(kind, key)
                if view is None:
                    damaged.append(row)
                else:
                    target.numpy()[:] = as_array(view)
        return damaged

    def reserve(self, nbytes: int, count: int) -> list[int]:
        """Up to `count` host slots of `nbytes`, evicting (and demoting) cold entries for room."""
        slots = self.host.alloc(nbytes, count)
        while len(slots) < count and self.host.fits(nbytes):
            want = max((count - len(slots)) * nbytes, int(self.host.budget_bytes * self.evict_slack))
            if not self.evict(Tier.HOST, want, nbytes):
                break
            slots += self.host.alloc(nbytes, count - len(slots))
        return slots

    def evict(self, tier: Tier, want_bytes: int, nbytes: int | None = None) -> int:
        """Free about `want_bytes` of `tier`, coldest first; host entries move to disk first.
        Prefers entries of `nbytes` (their slots are what the caller needs)."""
        candidates = self.index.candidates(tier, nbytes)
        if nbytes is not None and not len(candidates.rows):
            candidates = self.index.candidates(tier)  # other sizes: their slabs may empty
        order = self.policy.order(candidates)
        sizes = np.cumsum(candidates.nbytes[order])
        victims = candidates.rows[order][:int(np.searchsorted(sizes, want_bytes)) + 1]
        if not len(victims):
            return 0
        if tier == Tier.HOST and self.disk is not None:
            self.demote(victims)
        self.remove(victims, tier)
        self.counters["evicted_" + tier.name.lower()] += len(victims)
        return int(sizes[len(victims) - 1])

    def remove(self, rows: np.ndarray, tier: Tier) -> None:
        """Take unpinned entries out of one tier and give back their room."""
        if tier == Tier.HOST:
            slots, sizes = self.index.slots(rows, Tier.HOST), self.index.column("nbytes", rows)
            for size in np.unique(sizes).tolist():
                self.host.free(size, slots[sizes == size].tolist())
        elif tier == Tier.DISK:
            assert self.disk is not None
            kinds = self.index.column("kind", rows).tolist()
            self.disk.delete([(Kind(k), key) for k, key in zip(kinds, key_list(self.index.keys(rows)))])
        self.index.unpublish(rows, tier)

    def demote(self, rows: np.ndarray) -> int:
        """Write host entries to disk (those not there yet) in one transaction; returns how
        many were written (0 when they cannot fit the disk tier)."""
        assert self.disk is not None
        index = self.index
        rows = rows[~index.in_tier(rows, Tier.DISK)]
        sizes = index.column("nbytes", rows)
        total = int(sizes.sum())
        if not len(rows) or total > self.disk.budget_bytes:
            return 0
        slots = index.slots(rows, Tier.HOST)
        entries = [(Kind(kind), key, depth, self.host.pool(size).view(slot).numpy())
                   for kind, key, depth, size, slot in zip(
                       index.column("kind", rows).tolist(), key_list(index.keys(rows)),
                       index.column("depth", rows).tolist(), sizes.tolist(), slots.tolist())]
        index.pin(rows)  # not candidates for the disk evictions below
        try:
            written = self._write_disk(entries, total)
        finally:
            index.unpin(rows)
        if written:
            index.add_tier(rows, Tier.DISK)
            self.counters["demoted"] += len(rows)
        return len(rows) if written else 0

    def _write_disk(self, entries: list, total: int) -> bool:
        """Make room for `total` bytes on disk and write the entries in one transaction."""
        assert self.disk is not None
        over = self.disk.used_bytes + total - self.disk.budget_bytes
        if over > 0:
            self.evict(Tier.DISK, over)
        for _ in range(_DISK_RETRIES):
            try:
                self.disk.write(entries)
                return True
            except DiskFull:  # LMDB's own overhead beyond the budget: make more room, retry
                if not self.evict(Tier.DISK, max(total, self.disk.budget_bytes // 10)):
                    return False
        return False

    def drop(self, rows: np.ndarray) -> None:
        """Remove damaged entries from every tier. One a load is still reading stays:
        that load finds out for itself and drops it when it ends."""
        rows = rows[self.index.column("pins", rows) == 0]
        for tier in (Tier.HOST, Tier.DISK):
            inside = rows[self.index.in_tier(rows, tier)]
            if len(inside):
                self.remove(inside, tier)
