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
from collections import deque
from itertools import groupby
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from tiercache.buffers import WorkerBuffers, row_ids
from tiercache.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from tiercache.hashing import Keys, key_array
from tiercache.index import Hit, Index, Kind, Match, StopReason, Tier
from tiercache.keymap import KeyMap
from tiercache.layout import Layout
from tiercache.policy import make_policy
from tiercache.tiering import Tiering
from tiercache.tiers.arena import SlabPart, SlotArena
from tiercache.tiers.disk import DiskConfig, DiskTier
from tiercache.tiers.host import HostConfig, host_arena
from tiercache.transfer import CpuTransfer, CudaTransfer

Transfer = CpuTransfer | CudaTransfer

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
    checkpoints: tuple[int, ...] = ()  # page counts whose checkpoint is now cached

    def __add__(self, other: "StoreResult") -> "StoreResult":
        return StoreResult(self.stored + other.stored, self.present + other.present,
                           self.skipped + other.skipped, self.checkpoints + other.checkpoints)


@dataclass(frozen=True)
class LoadResult:
    match: Match  # what is now in the worker's rows
    bytes_from: dict[Tier, int]  # bytes copied out of each tier
    damaged: int  # damaged entries dropped on the way (each one retried the load)
    done: Any = None  # asynchronous GPU loads: the (interprocess) event that marks the bytes in place


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
class _Delivery:
    bytes_from: dict[Tier, int]
    damaged: int
    promoted: int
    event: Any = None


@dataclass
class _Group:
    """One kind of entry moving between the worker and the tiers."""

    kind: Kind
    buffers: tuple[torch.Tensor, ...]
    offsets: list[int]
    nbytes: int
    transfer: Transfer


def _pages(buffers: WorkerBuffers, transfer: Transfer) -> _Group:
    return _Group(Kind.PAGE, buffers.paged, buffers.page_offsets, buffers.layout.page_bytes, transfer)


def _checkpoints(buffers: WorkerBuffers, transfer: Transfer) -> _Group:
    return _Group(Kind.CHECKPOINT, buffers.slots, buffers.slot_offsets,
                  buffers.layout.checkpoint_bytes, transfer)


class Engine:
    def __init__(self, config: EngineConfig, index: Index, host: SlotArena,
                 disk: DiskTier | None) -> None:
        self.config = config
        self.index = index
        self.host = host
        self.disk = disk
        self.transfer = CpuTransfer(config.copy_threads)
        self._cuda: dict[int, CudaTransfer] = {}  # one per GPU that workers use, made on demand
        self._pending: list[tuple[Any, np.ndarray, list[torch.Tensor]]] = []  # async loads in flight
        # the last interprocess events handed out: a worker may open one after its copy is
        # done, and an exported event must still exist then
        self._handed_out: deque = deque(maxlen=1024)
        self._lock = threading.RLock()
        self._inflight = (KeyMap(), KeyMap())  # by Kind: entries a store is writing now
        self._closed = False
        self.counters: dict[str, int] = dict.fromkeys(
            ["matches", "matched_pages", "stored_pages", "stored_checkpoints", "skipped_entries",
             "loads", "loaded_pages", "demoted", "promoted", "evicted_host", "evicted_disk"], 0)
        self.tiers = Tiering(index, host, disk, make_policy(config.policy), self.counters,
                             config.evict_slack)

    @classmethod
    def open(cls, config: EngineConfig = EngineConfig()) -> "Engine":
        """Allocate the tiers and, on an existing disk directory, rebuild the index from it."""
        disk = DiskTier.open(config.disk) if config.disk else None
        engine = cls(config, Index(), host_arena(config.host), disk)
        if disk is not None:
            engine._rebuild(disk)
        return engine

    def _rebuild(self, disk: DiskTier) -> None:
        """Index what the disk holds, oldest first, one stamp per original write."""
        batches = groupby(disk.scan(), key=lambda r: (r.created_ns, r.kind, r.nbytes))
        created = None
        for (when, kind, nbytes), records in batches:
            if when != created:
                created = when
                self.index.tick()
            batch = list(records)
            self.index.publish(kind, key_array([r.key for r in batch]), [r.depth for r in batch],
                               nbytes, Tier.DISK)

    def flush(self) -> int:
        """Write every host entry that is not on disk yet to disk (they stay in the host).
        Returns how many were written; without a disk tier, 0."""
        with self._lock:
            self._check_open()
            if self.disk is None:
                return 0
            rows = np.setdiff1d(self.index.rows_in(Tier.HOST), self.index.rows_in(Tier.DISK))
            return self.tiers.demote(rows)

    def close(self, flush: bool = True) -> None:
        """Flush the host tier to disk (unless told not to) and release everything.
        Afterwards every call fails: the index would name bytes that are gone."""
        with self._lock:
            if self._closed:
                return
            if flush:
                self.flush()
            for cuda in self._cuda.values():
                cuda.close()  # waits for every copy in flight
            self._reap()
            self.transfer.close()
            self.host.close()
            if self.disk is not None:
                self.disk.close()
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("the engine is closed: open a new one with Engine.open")

    # -- store ------------------------------------------------------------------------
    def _transfer_for(self, buffers: WorkerBuffers) -> Transfer:
        """The copy path for a worker's buffers, chosen by the device they live on."""
        if buffers.device.type != "cuda":
            return self.transfer
        with self._lock:
            index = buffers.device.index or 0
            if index not in self._cuda:
                self._cuda[index] = CudaTransfer.open(buffers.device)
            return self._cuda[index]

    def quiesce(self, buffers: WorkerBuffers) -> None:
        """Return once no copy of this engine touches `buffers` (before they are unmapped)."""
        transfer = self._transfer_for(buffers)
        transfer.synchronize()
        if isinstance(transfer, CudaTransfer):
            transfer.forget(buffers.paged)
            transfer.forget(buffers.slots)
        with self._lock:
            self._reap()

    def store(self, buffers: WorkerBuffers, keys: Keys, rows: Sequence[int] = (),
              checkpoints: Mapping[int, int] | None = None, ready: Any = None) -> StoreResult:
        """Store a prompt after prefill: its KV pages (keys[i] from rows[i]; none for a
        layout without paged buffers) and the checkpoints offered, {pages: state slot},
        each the state after that many pages. On a GPU, copies start after `ready` (an
        event the worker recorded after writing the rows); the call returns when the
        worker may reuse its rows."""
        chain = key_array(keys)
        offered = dict(checkpoints or {})
        bad = [n for n in offered if not 0 < n <= len(chain)]
        if bad:
            raise InvalidArgument(f"checkpoint at page {bad[0]} is outside the prompt's "
                                  f"{len(chain)} full pages")
        result = StoreResult(0, 0, 0)
        if buffers.layout.needs_pages:
            result += self.store_pages(buffers, chain, rows, ready)
        elif len(rows):
            raise InvalidArgument("this layout has no paged buffers: give no kv rows")
        for pages, slot in sorted(offered.items()):
            result += self.store_checkpoint(buffers, chain[:pages], slot, ready)
        return result

    def store_pages(self, buffers: WorkerBuffers, keys: Keys, rows: Sequence[int],
                    ready: Any = None) -> StoreResult:
        """Store the KV pages of a prompt: keys[i] (page i+1 of the chain) from rows[i]."""
        if not buffers.layout.needs_pages:
            raise InvalidArgument("this layout has no paged buffers: store a checkpoint instead")
        chain = key_array(keys)
        src = row_ids(rows, buffers.layout.page_rows, "kv row")
        if len(src) != len(chain):
            raise InvalidArgument(f"got {len(chain)} page keys but {len(src)} kv rows: give one row per page")
        return self._store(_pages(buffers, self._transfer_for(buffers)), chain,
                           np.arange(1, len(chain) + 1), src, ready)

    def store_checkpoint(self, buffers: WorkerBuffers, keys: Keys, slot: int,
                         ready: Any = None) -> StoreResult:
        """Store the state in `slot`, taken after the last page of the chain `keys`."""
        if not buffers.layout.needs_checkpoint:
            raise InvalidArgument("this layout has no slot buffers: it has no checkpoints")
        chain = key_array(keys)
        if not len(chain):
            raise InvalidArgument("a checkpoint needs the page keys of its prefix, got none")
        src = row_ids([slot], buffers.layout.slot_rows, "state slot")
        result = self._store(_checkpoints(buffers, self._transfer_for(buffers)), chain[-1:],
                             np.array([len(chain)]), src, ready)
        kept = (len(chain),) if result.stored or result.present else ()
        return StoreResult(result.stored, result.present, result.skipped, kept)

    def _store(self, group: _Group, keys: np.ndarray, depths: np.ndarray,
               src: np.ndarray, ready: Any) -> StoreResult:
        group.transfer.wait_for(ready, "store")
        with self._lock:
            self._check_open()
            self._reap()
            stamp = self.index.tick()
            existing = self.index.rows_of(group.kind, keys)
            self.index.touch(existing[existing >= 0])
            new = np.flatnonzero(existing < 0)
            inflight = self._inflight[group.kind]
            todo = new[inflight.lookup(keys[new]) < 0]  # another store is writing the rest
            inflight.insert(keys[todo], todo)
        stored = 0
        try:
            while stored < len(todo):  # in batches: each one may push the last out to disk
                with self._lock:
                    slots = self.tiers.reserve(group.nbytes, len(todo) - stored)
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
                    self.index.publish(group.kind, keys[batch], depths[batch], group.nbytes,
                                       Tier.HOST, slots, stamp)
                stored += len(batch)
        finally:
            with self._lock:
                inflight.delete(keys[todo])
                counter = "stored_pages" if group.kind == Kind.PAGE else "stored_checkpoints"
                self.counters[counter] += stored
                self.counters["skipped_entries"] += len(todo) - stored
        if len(todo) and not stored:
            raise ResourceExhausted(
                f"no room in the host tier for a {group.nbytes}-byte entry (budget "
                f"{self.host.budget_bytes} bytes, the rest pinned by loads): raise the host budget")
        return StoreResult(stored=stored, present=len(keys) - len(todo),
                           skipped=len(todo) - stored)

    def _gather(self, group: _Group, src: np.ndarray, slots: np.ndarray) -> None:
        """Copy worker rows into host slots; returns once the worker may reuse the rows."""
        group.transfer.gather(group.buffers, group.offsets, src,
                              list(self.host.pool(group.nbytes).parts(slots)))
        group.transfer.fence("store").synchronize()  # this batch only, not the device

    # -- match and load -----------------------------------------------------------------
    def match(self, layout: Layout, keys: Keys) -> Match:
        with self._lock:
            hit = self._match(layout, key_array(keys))
            self.counters["matches"] += 1
            self.counters["matched_pages"] += hit.match.pages
            return hit.match

    def _match(self, layout: Layout, keys: np.ndarray) -> Hit:
        self._check_open()
        self._reap()
        self.index.tick()
        hit = self.index.match(keys, layout.page_tokens, layout.needs_pages, layout.needs_checkpoint)
        self.index.touch(hit.rows)
        return hit

    def load(self, buffers: WorkerBuffers, keys: Keys, rows: Sequence[int] = (),
             slot: int | None = None, ready: Any = None, asynchronous: bool = False) -> LoadResult:
        """Copy the longest hybrid match of `keys` (at most len(rows) pages) into `rows` and
        `slot`. Fails as a whole: a damaged entry is dropped and the load redone shorter.

        On a GPU, copies start after `ready` (an event the worker recorded after its last
        use of the rows). The call returns when the bytes are in place, or, if
        `asynchronous`, at once with `LoadResult.done`: an interprocess event the worker's
        stream waits on; the entries stay pinned until it completes."""
        layout, keys = buffers.layout, key_array(keys)
        dst = row_ids(rows, layout.page_rows, "kv row", unique=True)
        limit = len(dst) if layout.needs_pages else len(keys)
        dst_slot = np.empty(0, np.int64)
        if layout.needs_checkpoint:
            if slot is None:
                raise InvalidArgument("this layout has slot buffers: give the state slot to load into")
            dst_slot = row_ids([slot], layout.slot_rows, "state slot")
        damaged = 0
        for _ in range(_LOAD_ATTEMPTS):
            with self._lock:
                hit = self._match(layout, keys[:limit])
                if hit.match.pages == 0:
                    return LoadResult(hit.match, {}, damaged)
                self.index.pin(hit.rows)
            transfer = self._transfer_for(buffers)
            transfer.wait_for(ready, "load")
            moves = [(_pages(buffers, transfer), hit.page_rows, dst[:hit.match.pages])]
            if hit.checkpoint_row is not None:
                moves.append((_checkpoints(buffers, transfer), np.array([hit.checkpoint_row]),
                              dst_slot))
            done = self._deliver(hit.rows, moves, transfer, asynchronous)
            damaged += done.damaged
            if not done.damaged:
                with self._lock:
                    self.counters["loads"] += 1
                    self.counters["loaded_pages"] += hit.match.pages
                return LoadResult(hit.match, done.bytes_from, damaged, done.event)
        return LoadResult(Match(0, 0, len(keys), b"", None, StopReason.MISSING_PAGE), {}, damaged)

    def prefetch(self, layout: Layout, keys: Keys) -> int:
        """Copy the disk-only entries of the hybrid match of `keys` into the host tier, so a
        load that follows finds them there. Returns how many entries moved."""
        with self._lock:
            hit = self._match(layout, key_array(keys))
            if self.disk is None or hit.match.pages == 0:
                return 0
            self.index.pin(hit.rows)
        moves = [(_Group(Kind.PAGE, (), [], layout.page_bytes, self.transfer), hit.page_rows, None)]
        if hit.checkpoint_row is not None:
            moves.append((_Group(Kind.CHECKPOINT, (), [], layout.checkpoint_bytes, self.transfer),
                          np.array([hit.checkpoint_row]), None))
        return self._deliver(hit.rows, moves, self.transfer, False).promoted

    def _deliver(self, pinned: np.ndarray, moves: list[tuple[_Group, np.ndarray, np.ndarray | None]],
                 transfer: Transfer, asynchronous: bool) -> _Delivery:
        """Bring pinned entries into host memory (promoting disk hits) and, where a move
        names destination rows, scatter them into the worker. `pinned` is unpinned when
        the copies are done: now, or, for an asynchronous load, once its event completes."""
        done = _Delivery({}, 0, 0)
        damaged: list[int] = []
        promoted: list[tuple[np.ndarray, list[int], int]] = []  # (rows, host slots, nbytes)
        staging: list[torch.Tensor] = []  # must outlive the copies that read it
        try:
            for group, entry_rows, dst in moves:
                staged = self._stage(group, entry_rows, dst is not None, damaged, promoted)
                if staged is None or dst is None:
                    continue
                parts, from_disk, buffer = staged
                staging.append(buffer)
                transfer.scatter(parts, group.buffers, group.offsets, dst)
                for tier, count in ((Tier.HOST, len(entry_rows) - from_disk), (Tier.DISK, from_disk)):
                    if count:
                        done.bytes_from[tier] = done.bytes_from.get(tier, 0) + count * group.nbytes
            done.event = transfer.fence("load", interprocess=asynchronous)
            if not asynchronous:
                done.event.synchronize()
        except BaseException:
            transfer.synchronize()  # nothing may still read entries we are about to unpin
            raise
        finally:
            with self._lock:
                if done.event is not None and asynchronous and not damaged:
                    self._pending.append((done.event, pinned, staging))
                    self._handed_out.append(done.event)
                else:
                    self.index.unpin(pinned)
                for rows, slots, nbytes in promoted:
                    if damaged:
                        self.host.free(nbytes, slots)
                    else:
                        self.index.add_tier(rows, Tier.HOST, slots)
                        done.promoted += len(rows)
                self.counters["promoted"] += done.promoted
                self.tiers.drop(np.asarray(damaged, np.int64))
        done.damaged = len(damaged)
        if not asynchronous:
            done.event = None
        return done

    def _reap(self) -> None:
        """Unpin the entries of asynchronous loads whose copies have finished (under the
        lock)."""
        if self._pending:
            waiting = []
            for event, rows, staging in self._pending:
                if event.query():
                    self.index.unpin(rows)
                else:
                    waiting.append((event, rows, staging))
            self._pending = waiting

    def _stage(self, group: _Group, entry_rows: np.ndarray, staging_ok: bool, damaged: list[int],
               promoted: list[tuple[np.ndarray, list[int], int]]
               ) -> tuple[list[SlabPart], int, torch.Tensor] | None:
        """Host memory holding the pinned `entry_rows`: their host slots, where disk entries
        are first read into new host slots (promotion) or, when the host has no room and
        `staging_ok`, into a staging buffer (page-locked for a GPU). Returns (parts, entries
        read from disk, the staging buffer), or None when a disk entry turned out damaged."""
        nbytes = group.nbytes
        with self._lock:
            in_host = self.index.in_tier(entry_rows, Tier.HOST)
            slots = np.where(in_host, self.index.slots(entry_rows, Tier.HOST), -1)
            from_disk = np.flatnonzero(~in_host)
            promo = self.tiers.reserve(nbytes, len(from_disk)) if len(from_disk) else []
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
                with self._lock:
                    self.host.free(nbytes, promo)
                return None
            slots[from_disk[:len(promo)]] = promo
            promoted.append((entry_rows[from_disk[:len(promo)]], promo, nbytes))
        at = np.flatnonzero(slots >= 0)
        parts = [SlabPart(p.slab, p.local, at[p.positions]) for p in pool.parts(slots[at])]
        if len(staging):
            parts.append(SlabPart(staging, np.arange(len(staging)), from_disk[len(promo):]))
        return parts, len(from_disk), staging

    def evict(self, keys: Keys | None = None, tier: Tier | None = None) -> int:
        """Drop the pages and checkpoints named by `keys` (all entries if None) from `tier`
        (every tier if None); entries a load is reading stay. Returns how many entries
        were dropped from at least one tier."""
        tiers = [t for t in (Tier.HOST, Tier.DISK) if tier is None or t == tier]
        with self._lock:
            self._check_open()
            if keys is None:
                rows = np.unique(np.concatenate([self.index.rows_in(t) for t in tiers]))
            else:
                found = np.concatenate([self.index.rows_of(kind, key_array(keys)) for kind in Kind])
                rows = np.unique(found[found >= 0])
            rows = rows[self.index.column("pins", rows) == 0]
            dropped = np.zeros(len(rows), bool)
            for t in tiers:
                inside = self.index.in_tier(rows, t)
                dropped |= inside
                if inside.any():
                    self.tiers.remove(rows[inside], t)
            return int(dropped.sum())

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
