"""Making room in a tier: which entries go (in the eviction policy's order), and what
must move before they may go: a host entry not on disk yet is written down, a device
entry without a host copy is copied down, and a disk entry's LMDB records are deleted.
None of that I/O happens here: victims that must move are pinned and handed back as
`Displaced` work, which the caller moves outside the lock (background.Mover.settle) and
then completes. Also the batches the background writer and copier work on.

Not thread-safe: the books (books.py) call it under their lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tiercache.arrays import distinct
from tiercache.counters import Counters, EvictReason
from tiercache.hashing import PageKey, key_list
from tiercache.index import Index
from tiercache.policy import EvictionPolicy
from tiercache.results import Kind, Tier
from tiercache.tiers.arena import SlotArena
from tiercache.tiers.disk import DiskTier
from tiercache.tuning import AlphaTuner


@dataclass(frozen=True)
class DiskBatch:
    """Host entries on their way to disk: pinned, so their slots stay as they are."""

    rows: np.ndarray
    entries: list  # (kind, key, depth, bytes) as DiskTier.write takes them
    nbytes: int
    checks: list  # of each entry (Index.usable)


@dataclass(frozen=True)
class DownBatch:
    """Device entries on their way to host slots: (rows, host slots, entry size, device
    slots) groups; the rows are pinned, so the slots stay as they are."""

    rows: np.ndarray
    placed: list


@dataclass(frozen=True)
class Leaving:
    """Entries leaving this node for good, to be handed to the remote tier first (its
    write-on-eviction policy): `rows` pinned in the host, with `entries` (kind, key,
    depth, host view, check), when there is no disk; else the LMDB records of disk
    victims, read before they are deleted (`entries` with None for the bytes)."""

    rows: np.ndarray
    entries: list


@dataclass
class Displaced:
    """What evictions displaced, to be moved outside the lock and then completed: host
    entries to write to disk before they go (`demote`), device entries to copy to the host
    before they go (`down`), disk entries whose LMDB records to delete (`deletes`), and
    entries to hand to the remote tier before they leave the node (`leaving`)."""

    demote: DiskBatch | None = None
    down: DownBatch | None = None
    deletes: list[tuple[Kind, PageKey]] = field(default_factory=list)
    delete_bytes: int = 0
    leaving: Leaving | None = None

    def __bool__(self) -> bool:
        return bool(self.demote or self.down or self.deletes or self.leaving)


class Room:
    def __init__(self, index: Index, host: SlotArena, disk: DiskTier | None,
                 policy: EvictionPolicy, evict_slack: float, counters: Counters,
                 tuner: AlphaTuner | None) -> None:
        self.index = index
        self.host = host
        self.disk = disk
        self.device: SlotArena | None = None  # the GPU arena, once a GPU worker brings one
        self.policy = policy
        self.evict_slack = evict_slack  # an eviction frees at least this share of the budget
        self.counters = counters
        self.tuner = tuner
        self.writing_bytes = 0  # disk room promised to batches being written
        self.deleting: dict[bytes, int] = {}  # LMDB records being deleted: db key -> bytes
        self.writing: set[int] = set()  # host rows a disk batch has taken
        self.copying_down: set[int] = set()  # device rows a copy down has taken
        self.hand_off = False  # entries leaving the node go to the remote tier first

    def arena(self, tier: Tier) -> SlotArena:
        arena = self.device if tier == Tier.DEVICE else self.host
        assert arena is not None, f"no {tier.name} arena"
        return arena

    def reserve(self, nbytes: int, count: int, tier: Tier, displaced: Displaced,
                 clean_only: bool) -> list[int]:
        arena = self.arena(tier)
        slots = arena.alloc(nbytes, count)
        while len(slots) < count and arena.fits(nbytes):
            want = max((count - len(slots)) * arena.charge(nbytes),
                       int(arena.budget_bytes * self.evict_slack))
            if not self.evict(tier, want, displaced, clean_only):
                break
            slots += arena.alloc(nbytes, count - len(slots))
        return slots

    def evict(self, tier: Tier, want_bytes: int, displaced: Displaced, clean_only: bool) -> int:
        """Free about `want_bytes` of `tier` (of its budget: a tiny entry's slot takes the
        arena's floor) in the policy's order; victims that must move first are displaced
        (or, with `clean_only`, left alone). Returns the bytes freed now or once the
        displaced work is done."""
        candidates = self.index.candidates(tier)
        floor = 0 if tier == Tier.DISK else self.arena(tier).min_slot_bytes
        if clean_only or (tier == Tier.HOST and (displaced.demote or displaced.leaving)) or (
                tier == Tier.DEVICE and displaced.down is not None):
            clean = ~self.must_move(candidates.rows, tier)  # one batch of moves at a time
            candidates = type(candidates)(*(getattr(candidates, f)[clean] for f in
                                            ("rows", "stamp", "depth", "kind", "nbytes", "value")))
        order = self.policy.order(candidates)
        sizes = np.cumsum(np.maximum(candidates.nbytes[order], floor))
        chosen = order[:int(np.searchsorted(sizes, want_bytes)) + 1]
        victims = candidates.rows[chosen]
        if not len(victims):
            return 0
        if tier == Tier.HOST and self.tuner is not None:
            self.tuner.evicted(candidates, chosen, self.index.keys(victims))
        moving = self.must_move(victims, tier)
        if moving.any() and tier == Tier.HOST and self.disk is None:  # leaving for the remote tier
            displaced.leaving = self.begin_leaving(victims[moving])
        elif moving.any() and tier == Tier.HOST:
            displaced.demote = self.begin_write(victims[moving], len(victims), displaced)
            # what the batch could not take (no room on disk) is dropped, as a cache may
            moving &= np.isin(victims, displaced.demote.rows if displaced.demote else [])
        elif moving.any():
            displaced.down = self.begin_copy_down(victims[moving], displaced)
        if tier == Tier.DISK and self.hand_off:  # their records are read before they go
            leaving = self._describe(victims[self.index.column("shared", victims) == 1], None)
            before = displaced.leaving.entries if displaced.leaving is not None else []
            displaced.leaving = Leaving(np.empty(0, np.int64), before + leaving)
        self.remove(victims[~moving], tier, displaced)
        self.counters.evicted[tier, EvictReason.CAPACITY] += len(victims)
        return int(sizes[len(victims) - 1])

    def must_move(self, rows: np.ndarray, tier: Tier) -> np.ndarray:
        """Which of `rows` would be lost by leaving `tier`: host entries not on disk (when
        there is one; without, those bound for the remote tier), device entries without a
        host copy."""
        if tier == Tier.HOST and self.disk is None:
            return self.index.column("shared", rows) == 1 if self.hand_off else np.zeros(len(rows), bool)
        if tier == Tier.HOST:
            return self.index.in_tier(rows, Tier.HOST) & ~self.index.in_tier(rows, Tier.DISK)
        if tier == Tier.DEVICE:
            return ~self.index.in_tier(rows, Tier.HOST)
        return np.zeros(len(rows), bool)

    def remove(self, rows: np.ndarray, tier: Tier, displaced: Displaced) -> None:
        """Take unpinned entries out of one tier and give back their room; LMDB records
        go to the displaced deletes."""
        if not len(rows):
            return
        if tier in (Tier.HOST, Tier.DEVICE):
            arena = self.arena(tier)
            slots, sizes = self.index.slots(rows, tier), self.index.column("nbytes", rows)
            for size in distinct(sizes).tolist():
                arena.free(size, slots[sizes == size].tolist())
        elif tier == Tier.DISK:
            kinds, sizes = self.index.column("kind", rows).tolist(), self.index.column("nbytes", rows)
            for kind, key, size in zip(kinds, key_list(self.index.keys(rows)), sizes.tolist()):
                displaced.deletes.append((Kind(kind), key))
                self.deleting[bytes((kind,)) + key] = size
                displaced.delete_bytes += size
        self.index.unpublish(rows, tier)

    def begin_write(self, rows: np.ndarray, limit: int, displaced: Displaced) -> DiskBatch | None:
        assert self.disk is not None
        index = self.index
        rows = distinct(rows)
        rows = rows[index.in_tier(rows, Tier.HOST) & ~index.in_tier(rows, Tier.DISK)
                    & ~np.isin(rows, list(self.writing))]  # one batch writes a row
        if self.deleting:  # a key whose old record is being deleted waits for that
            waiting = [bytes((k,)) + key in self.deleting for k, key in
                       zip(index.column("kind", rows).tolist(), key_list(index.keys(rows)))]
            rows = rows[~np.array(waiting, bool)]
        rows = rows[:limit]
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
        self.writing.update(rows.tolist())
        deleting = sum(self.deleting.values())
        over = self.disk.used_bytes - deleting + self.writing_bytes + total - self.disk.budget_bytes
        if over > 0:
            self.evict(Tier.DISK, over, displaced, clean_only=False)
        self.writing_bytes += total
        return DiskBatch(rows, entries, total, index.column("check", rows).tolist())

    def end_write(self, batch: DiskBatch, written: bool) -> int:
        """Publish a written batch in the disk tier (after its commit) and unpin it."""
        self.writing_bytes -= batch.nbytes
        self.writing.difference_update(batch.rows.tolist())
        self.index.unpin(batch.rows)
        if not written:
            return 0
        self.index.add_tier(batch.rows, Tier.DISK)
        return len(batch.rows)

    def begin_leaving(self, rows: np.ndarray) -> Leaving:
        """Pin host victims bound for the remote tier: their slots stay while it reads them."""
        self.index.pin(rows)
        return Leaving(rows, self._describe(rows, Tier.HOST))

    def _describe(self, rows: np.ndarray, tier: Tier | None) -> list:
        """(kind, key, depth, host view or None, check) of each row."""
        index = self.index
        sizes = index.column("nbytes", rows).tolist()
        views = ([self.host.pool(size).view(slot).numpy() for size, slot in
                  zip(sizes, index.slots(rows, Tier.HOST).tolist())] if tier == Tier.HOST
                 else [None] * len(rows))
        return list(zip([Kind(k) for k in index.column("kind", rows).tolist()],
                        key_list(index.keys(rows)), index.column("depth", rows).tolist(), views,
                        index.column("check", rows).tolist()))

    def begin_copy_down(self, rows: np.ndarray, displaced: Displaced) -> DownBatch | None:
        """Pin device entries and reserve host slots for them, evicting only host entries
        that need no move (a copy down never waits on disk writes)."""
        if self.copying_down:  # one copy each (usually none is under way)
            rows = rows[np.array([r not in self.copying_down for r in rows.tolist()], bool)]
        if not len(rows):
            return None
        self.copying_down.update(rows.tolist())
        self.index.pin(rows)  # pinned while read, and no candidate for the evictions below
        placed, sizes = [], self.index.column("nbytes", rows)
        for size in distinct(sizes).tolist():
            group = rows[sizes == size]
            slots = self.reserve(size, len(group), Tier.HOST, displaced, clean_only=True)
            group = group[:len(slots)]
            placed.append((group, np.asarray(slots, np.int64), size,
                           self.index.slots(group, Tier.DEVICE)))
        return DownBatch(rows, placed)

    def end_copy_down(self, batch: DownBatch, copied: bool) -> int:
        """Publish the copies in the host (after they are complete) and unpin."""
        self.index.unpin(batch.rows)
        self.copying_down.difference_update(batch.rows.tolist())
        done = 0
        for rows, slots, size, _ in batch.placed:
            if copied:
                self.index.add_tier(rows, Tier.HOST, slots)
                done += len(rows)
            else:
                self.host.free(size, slots.tolist())
        return done

    def complete(self, displaced: Displaced, demoted: bool, copied: bool) -> int:
        """After the displaced work was done: publish what reached the lower tier and let
        those victims go. Host victims whose write failed are dropped all the same, as a
        cache may; device victims that found no host room stay (nothing on the device
        is lost to make room). Those a load pinned meanwhile stay too. Returns how many
        left their tier."""
        gone = 0
        if displaced.leaving is not None and len(displaced.leaving.rows):
            rows = displaced.leaving.rows
            self.index.unpin(rows)  # handed off or not, they go, as a cache may
            rows = rows[(self.index.column("pins", rows) == 0) & self.index.in_tier(rows, Tier.HOST)]
            self.remove(rows, Tier.HOST, displaced)
            gone += len(rows)
        if displaced.demote is not None:
            rows = displaced.demote.rows
            self.counters.demoted += self.end_write(displaced.demote, demoted)
            rows = rows[self.index.column("pins", rows) == 0]
            self.remove(rows, Tier.HOST, displaced)
            gone += len(rows)
        if displaced.down is not None:
            rows = displaced.down.rows
            self.counters.copied_down += self.end_copy_down(displaced.down, copied)
            rows = rows[(self.index.column("pins", rows) == 0) & self.index.in_tier(rows, Tier.DEVICE)
                        & self.index.in_tier(rows, Tier.HOST)]
            self.remove(rows, Tier.DEVICE, displaced)
            gone += len(rows)
        return gone
