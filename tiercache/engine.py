"""The embedded engine: store, match, load and evict over the host and disk tiers.

Stores land in the host arena; when it is full, its coldest entries move to disk before
their slots are reused. Loads copy from the best tier into the worker's rows; a disk hit
is promoted to the host on the way. The index only ever shows committed bytes
(invariant 1), a load delivers its whole match or fails as a whole (invariant 2), and
entries a load reads are pinned until it ends (invariant 3). Index and tier bookkeeping
happen under one lock; bytes are copied outside it, into slots nobody else can see yet
or out of pinned entries.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from tiercache.buffers import WorkerBuffers, row_ids
from tiercache.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from tiercache.hashing import PageKey
from tiercache.index import Hit, Index, Kind, Match, StopReason, Tier
from tiercache.layout import Layout
from tiercache.policy import make_policy
from tiercache.tiers.arena import SlabPart, SlotArena
from tiercache.tiers.disk import DiskConfig, DiskFull, DiskTier, as_array
from tiercache.tiers.host import HostConfig, host_arena
from tiercache.transfer import CpuTransfer

_LOAD_ATTEMPTS = 4  # a damaged entry found during a load drops it and retries the load


@dataclass(frozen=True)
class EngineConfig:
    host: HostConfig = field(default_factory=HostConfig)
    disk: DiskConfig | None = None
    policy: str = "lru"
    copy_threads: int = 2
    evict_slack: float = 0.01  # an eviction frees at least this share of the tier's budget


@dataclass(frozen=True)
class StoreResult:
    stored: int  # entries written now
    present: int  # entries that were cached already (their last use is refreshed)
    skipped: int  # entries left out for lack of room


@dataclass(frozen=True)
class LoadResult:
    match: Match  # what is now in the worker's rows
    bytes_from: dict[Tier, int]  # bytes copied out of each tier
    damaged: int  # damaged entries dropped on the way (each one retried the load)


@dataclass(frozen=True)
class TierStats:
    tier: Tier
    entries: int
    used_bytes: int
    budget_bytes: int


@dataclass(frozen=True)
class EngineStats:
    tiers: tuple[TierStats, ...]
    counters: dict[str, int]


@dataclass
class _Group:
    """One kind of entry moving between the worker and the tiers."""

    kind: Kind
    buffers: tuple[torch.Tensor, ...]
    offsets: list[int]
    nbytes: int


def _pages(buffers: WorkerBuffers) -> _Group:
    return _Group(Kind.PAGE, buffers.paged, buffers.page_offsets, buffers.layout.page_bytes)


def _checkpoints(buffers: WorkerBuffers) -> _Group:
    return _Group(Kind.CHECKPOINT, buffers.slots, buffers.slot_offsets, buffers.layout.checkpoint_bytes)


class Engine:
    def __init__(self, config: EngineConfig, index: Index, host: SlotArena,
                 disk: DiskTier | None) -> None:
        self.config = config
        self.index = index
        self.host = host
        self.disk = disk
        self.policy = make_policy(config.policy)
        self.transfer = CpuTransfer(config.copy_threads)
        self._lock = threading.RLock()
        self._inflight: set[tuple[Kind, PageKey]] = set()
        self._closed = False
        self.counters: dict[str, int] = dict.fromkeys(
            ["matches", "matched_pages", "stored_pages", "stored_checkpoints", "skipped_entries",
             "loads", "loaded_pages", "demoted", "promoted", "evicted_host", "evicted_disk"], 0)

    @classmethod
    def open(cls, config: EngineConfig = EngineConfig()) -> "Engine":
        """Allocate the tiers and, on an existing disk directory, rebuild the index from it."""
        disk = DiskTier.open(config.disk) if config.disk else None
        engine = cls(config, Index(), host_arena(config.host), disk)
        if disk is not None:
            engine._rebuild(disk)
        return engine

    def _rebuild(self, disk: DiskTier) -> None:
        created = None
        for record in disk.scan():  # oldest first: one stamp per original store
            if record.created_ns != created:
                created = record.created_ns
                self.index.tick()
            self.index.publish(record.kind, record.key, record.depth, record.nbytes, Tier.DISK)

    def flush(self) -> int:
        """Write every host entry that is not on disk yet to disk (they stay in the host).
        Returns how many were written; without a disk tier, 0."""
        with self._lock:
            self._check_open()
            if self.disk is None:
                return 0
            rows = np.setdiff1d(self.index.rows_in(Tier.HOST), self.index.rows_in(Tier.DISK))
            return self._demote(rows)

    def close(self, flush: bool = True) -> None:
        """Flush the host tier to disk (unless told not to) and release everything.
        Afterwards every call fails: the index would name bytes that are gone."""
        with self._lock:
            if self._closed:
                return
            if flush:
                self.flush()
            self.transfer.close()
            self.host.close()
            if self.disk is not None:
                self.disk.close()
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("the engine is closed: open a new one with Engine.open")

    # -- store ------------------------------------------------------------------------
    def store_pages(self, buffers: WorkerBuffers, keys: Sequence[PageKey],
                    rows: Sequence[int]) -> StoreResult:
        """Store the KV pages of a prompt: keys[i] (page i+1 of the chain) from rows[i]."""
        if not buffers.layout.needs_pages:
            raise InvalidArgument("this layout has no paged buffers: store a checkpoint instead")
        src = row_ids(rows, buffers.layout.page_rows, "kv row")
        if len(src) != len(keys):
            raise InvalidArgument(f"got {len(keys)} page keys but {len(src)} kv rows: give one row per page")
        return self._store(_pages(buffers), list(keys), list(range(1, len(keys) + 1)), src)

    def store_checkpoint(self, buffers: WorkerBuffers, keys: Sequence[PageKey],
                         slot: int) -> StoreResult:
        """Store the state in `slot`, taken after the last page of the chain `keys`."""
        if not buffers.layout.needs_checkpoint:
            raise InvalidArgument("this layout has no slot buffers: it has no checkpoints")
        if not keys:
            raise InvalidArgument("a checkpoint needs the page keys of its prefix, got none")
        src = row_ids([slot], buffers.layout.slot_rows, "state slot")
        return self._store(_checkpoints(buffers), [keys[-1]], [len(keys)], src)

    def _store(self, group: _Group, keys: list[PageKey], depths: list[int],
               src: np.ndarray) -> StoreResult:
        with self._lock:
            self._check_open()
            stamp = self.index.tick()
            existing = self.index.rows_of(group.kind, keys)
            self.index.touch(np.array([r for r in existing if r is not None], np.int64))
            todo = [i for i, row in enumerate(existing)
                    if row is None and (group.kind, keys[i]) not in self._inflight]
            claimed = [(group.kind, keys[i]) for i in todo]
            self._inflight.update(claimed)
        stored = 0
        try:
            while stored < len(todo):  # in batches: each one may push the last out to disk
                with self._lock:
                    slots = self._reserve(Tier.HOST, group.nbytes, len(todo) - stored)
                if not slots:
                    break
                batch = todo[stored:stored + len(slots)]  # shallow pages first
                try:
                    self._gather(group, src[batch], np.asarray(slots, np.int64))
                except BaseException:
                    with self._lock:
                        self.host.free(group.nbytes, slots)
                    raise
                with self._lock:
                    for i, slot in zip(batch, slots):
                        self.index.publish(group.kind, keys[i], depths[i], group.nbytes, Tier.HOST,
                                           slot=slot, stamp=stamp)
                stored += len(batch)
        finally:
            with self._lock:
                self._inflight.difference_update(claimed)
                counter = "stored_pages" if group.kind == Kind.PAGE else "stored_checkpoints"
                self.counters[counter] += stored
                self.counters["skipped_entries"] += len(todo) - stored
        if todo and not stored:
            raise ResourceExhausted(
                f"no room in the host tier for a {group.nbytes}-byte entry (budget "
                f"{self.host.budget_bytes} bytes, the rest pinned by loads): raise the host budget")
        return StoreResult(stored=stored, present=len(keys) - len(todo),
                           skipped=len(todo) - stored)

    def _gather(self, group: _Group, src: np.ndarray, slots: np.ndarray) -> None:
        pool = self.host.pool(group.nbytes)
        for part in pool.parts(slots):
            self.transfer.gather(group.buffers, group.offsets, src, part)

    # -- match and load -----------------------------------------------------------------
    def match(self, layout: Layout, keys: Sequence[PageKey]) -> Match:
        with self._lock:
            hit = self._match(layout, keys)
            self.counters["matches"] += 1
            self.counters["matched_pages"] += hit.match.pages
            return hit.match

    def _match(self, layout: Layout, keys: Sequence[PageKey]) -> Hit:
        self._check_open()
        self.index.tick()
        hit = self.index.match(keys, layout.page_tokens, layout.needs_pages, layout.needs_checkpoint)
        self.index.touch(hit.rows)
        return hit

    def load(self, buffers: WorkerBuffers, keys: Sequence[PageKey], rows: Sequence[int] = (),
             slot: int | None = None) -> LoadResult:
        """Copy the longest hybrid match of `keys` (at most len(rows) pages) into `rows` and
        `slot`. Fails as a whole: a damaged entry is dropped and the load redone shorter."""
        layout = buffers.layout
        dst = row_ids(rows, layout.page_rows, "kv row", unique=True)
        limit = len(dst) if layout.needs_pages else len(keys)
        dst_slot = np.empty(0, np.int64)
        if layout.needs_checkpoint:
            if slot is None:
                raise InvalidArgument("this layout has slot buffers: give the state slot to load into")
            dst_slot = row_ids([slot], layout.slot_rows, "state slot")
        damaged_total = 0
        for _ in range(_LOAD_ATTEMPTS):
            with self._lock:
                hit = self._match(layout, keys[:limit])
                if hit.match.pages == 0:
                    break
                self.index.pin(hit.rows)
            moves = [(_pages(buffers), hit.page_rows, dst[:hit.match.pages])]
            if hit.checkpoint_row is not None:
                moves.append((_checkpoints(buffers), np.array([hit.checkpoint_row]), dst_slot))
            bytes_from, damaged = self._deliver(hit, moves)
            damaged_total += damaged
            if not damaged:
                with self._lock:
                    self.counters["loads"] += 1
                    self.counters["loaded_pages"] += hit.match.pages
                return LoadResult(hit.match, bytes_from, damaged_total)
        empty = Match(0, 0, len(keys), (), None, StopReason.MISSING_PAGE)
        return LoadResult(hit.match if hit.match.pages == 0 else empty, {}, damaged_total)

    def _deliver(self, hit: Hit, moves: list[tuple[_Group, np.ndarray, np.ndarray]]
                 ) -> tuple[dict[Tier, int], int]:
        """Copy pinned entries into worker rows; unpins them. Returns (bytes per tier, damaged)."""
        bytes_from: dict[Tier, int] = {}
        damaged: list[int] = []
        promoted: list[tuple[int, int, int]] = []  # (row, slot, nbytes) to publish in the host
        try:
            for group, entry_rows, dst in moves:
                if len(entry_rows):
                    self._deliver_group(group, entry_rows, dst, bytes_from, damaged, promoted)
        finally:
            with self._lock:
                self.index.unpin(hit.rows)
                for row, slot, nbytes in promoted:
                    if damaged:
                        self.host.free(nbytes, [slot])
                    else:
                        self.index.publish(self.index.kind(row), self.index.key(row),
                                           self.index.depth(row), nbytes, Tier.HOST, slot=slot)
                self.counters["promoted"] += 0 if damaged else len(promoted)
                self._drop(damaged)
        return bytes_from, len(damaged)

    def _deliver_group(self, group: _Group, entry_rows: np.ndarray, dst: np.ndarray,
                       bytes_from: dict[Tier, int], damaged: list[int],
                       promoted: list[tuple[int, int, int]]) -> None:
        """Copy one kind of pinned entries into worker rows; disk entries go through the
        host (promoted into new host slots, or a staging buffer when the host is full)."""
        index, nbytes = self.index, group.nbytes
        with self._lock:
            slots = np.array([index.slot(int(r), Tier.HOST) if index.tiers(int(r)) & Tier.HOST
                              else -1 for r in entry_rows], np.int64)
            from_disk = np.flatnonzero(slots < 0)
            promo = self._reserve(Tier.HOST, nbytes, len(from_disk)) if len(from_disk) else []
        pool = self.host.pool(nbytes)
        staging = torch.empty((len(from_disk) - len(promo), nbytes), dtype=torch.uint8)
        if len(from_disk):
            targets = [pool.view(s) for s in promo] + list(staging)
            bad = self._read_disk(group.kind, entry_rows[from_disk], targets)
            if bad:
                damaged.extend(bad)
                with self._lock:
                    self.host.free(nbytes, promo)
                return
            slots[from_disk[:len(promo)]] = promo
            promoted.extend((int(entry_rows[p]), s, nbytes) for p, s in zip(from_disk, promo))
        in_host = np.flatnonzero(slots >= 0)
        for part in pool.parts(slots[in_host]):
            self.transfer.scatter(SlabPart(part.slab, part.local, in_host[part.positions]),
                                  group.buffers, group.offsets, dst)
        staged = from_disk[len(promo):]
        if len(staged):
            self.transfer.scatter(SlabPart(staging, np.arange(len(staged)), staged),
                                  group.buffers, group.offsets, dst)
        for tier, count in ((Tier.HOST, len(entry_rows) - len(from_disk)), (Tier.DISK, len(from_disk))):
            if count:
                bytes_from[tier] = bytes_from.get(tier, 0) + count * nbytes

    def _read_disk(self, kind: Kind, rows: np.ndarray, targets: list[torch.Tensor]) -> list[int]:
        """Copy verified disk entries into `targets`; returns the rows found damaged."""
        assert self.disk is not None, "an entry in no memory tier must be on disk"
        damaged = []
        with self.disk.reader() as reader:
            for row, target in zip(rows, targets):
                view = reader.get(kind, self.index.key(int(row)))
                if view is None:
                    damaged.append(int(row))
                else:
                    target.numpy()[:] = as_array(view)
        return damaged

    # -- room and eviction ----------------------------------------------------------------
    def _reserve(self, tier: Tier, nbytes: int, count: int) -> list[int]:
        """Up to `count` host slots of `nbytes`, evicting (and demoting) cold entries for room."""
        assert tier == Tier.HOST
        slots = self.host.alloc(nbytes, count)
        while len(slots) < count and self.host.fits(nbytes):
            want = max((count - len(slots)) * nbytes, int(self.host.budget_bytes * self.config.evict_slack))
            if not self._evict(Tier.HOST, want, nbytes):
                break
            slots += self.host.alloc(nbytes, count - len(slots))
        return slots

    def _evict(self, tier: Tier, want_bytes: int, nbytes: int | None = None) -> int:
        """Free about `want_bytes` of `tier`, coldest first; host entries move to disk first."""
        candidates = self.index.candidates(tier, nbytes)
        if nbytes is not None and not len(candidates.rows):
            candidates = self.index.candidates(tier)  # other sizes: their slabs may empty
        order = self.policy.order(candidates)
        sizes = np.cumsum(candidates.nbytes[order])
        victims = candidates.rows[order][:int(np.searchsorted(sizes, want_bytes)) + 1]
        if not len(victims):
            return 0
        if tier == Tier.HOST:
            if self.disk is not None:
                self._demote(victims)
            for row in victims:
                slot, size = self.index.slot(int(row), Tier.HOST), self.index.nbytes(int(row))
                self.index.unpublish(int(row), Tier.HOST)
                self.host.free(size, [slot])
            self.counters["evicted_host"] += len(victims)
        else:
            assert self.disk is not None
            self.disk.delete([(self.index.kind(int(r)), self.index.key(int(r))) for r in victims])
            for row in victims:
                self.index.unpublish(int(row), Tier.DISK)
            self.counters["evicted_disk"] += len(victims)
        return int(sizes[len(victims) - 1])

    def _demote(self, rows: np.ndarray) -> int:
        """Write host entries to disk (those not there yet) in one transaction; returns how
        many were written (0 when they cannot fit the disk tier)."""
        assert self.disk is not None
        index = self.index
        rows = np.array([r for r in rows if not index.tiers(int(r)) & Tier.DISK], np.int64)
        total = int(sum(index.nbytes(int(r)) for r in rows))
        if not len(rows) or total > self.disk.budget_bytes:
            return 0
        entries = [(index.kind(int(r)), index.key(int(r)), index.depth(int(r)),
                    self.host.pool(index.nbytes(int(r))).view(index.slot(int(r), Tier.HOST)).numpy())
                   for r in rows]
        index.pin(rows)  # not candidates for the disk evictions below
        try:
            over = self.disk.used_bytes + total - self.disk.budget_bytes
            if over > 0:
                self._evict(Tier.DISK, over)
            for _ in range(_LOAD_ATTEMPTS):
                try:
                    self.disk.write(entries)
                    break
                except DiskFull:  # LMDB overhead beyond the budget: make more room, retry
                    if not self._evict(Tier.DISK, max(total, self.disk.budget_bytes // 10)):
                        return 0
            else:
                return 0
        finally:
            index.unpin(rows)
        for row in rows:
            index.publish(index.kind(int(row)), index.key(int(row)), index.depth(int(row)),
                          index.nbytes(int(row)), Tier.DISK, stamp=None)
        self.counters["demoted"] += len(rows)
        return len(rows)

    def _drop(self, rows: list[int]) -> None:
        """Remove entries from every tier they are in (a load still reading one finds out
        for itself and drops it when it ends)."""
        for row in rows:
            if self.index.pinned(row):
                continue
            tiers = self.index.tiers(row)
            if tiers & Tier.DISK and self.disk is not None:
                self.disk.delete([(self.index.kind(row), self.index.key(row))])
            if tiers & Tier.HOST:
                self.host.free(self.index.nbytes(row), [self.index.slot(row, Tier.HOST)])
            for tier in (Tier.HOST, Tier.DISK):
                if tiers & tier:
                    self.index.unpublish(row, tier)

    def evict(self, keys: Sequence[PageKey] | None = None) -> int:
        """Drop the pages and checkpoints named by `keys` (all entries if None) from every
        tier; entries a load is reading stay. Returns how many entries were dropped."""
        with self._lock:
            self._check_open()
            if keys is None:
                rows = [int(r) for t in (Tier.HOST, Tier.DISK) for r in self.index.rows_in(t)]
            else:
                rows = [r for kind in Kind for r in self.index.rows_of(kind, keys) if r is not None]
            rows = [r for r in dict.fromkeys(rows) if not self.index.pinned(r)]
            self._drop(rows)
            return len(rows)

    def stats(self) -> EngineStats:
        with self._lock:
            tiers = [TierStats(Tier.HOST, self.index.count[Tier.HOST], self.host.used_bytes,
                               self.host.budget_bytes)]
            if self.disk is not None:
                tiers.append(TierStats(Tier.DISK, self.index.count[Tier.DISK], self.disk.used_bytes,
                                       self.disk.budget_bytes))
            counters = dict(self.counters)
            counters["checksum_failures"] = self.disk.checksum_failures if self.disk else 0
            return EngineStats(tuple(tiers), counters)
