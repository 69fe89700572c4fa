"""The embedded engine: store, match, load and evict over the host and disk tiers.

Stores land in the host arena, keeping the checkpoints the admission policy picks of those
offered; a background thread copies host entries to disk (write-through, or ahead of their
eviction for write-back) and promotes disk hits a match asked for. When the host is full,
its entries go in the eviction policy's order. Loads copy from the best tier into the
worker's rows; a disk hit is promoted to the host on the way. The index only ever shows
committed bytes (invariant 1), a load delivers its whole match or fails as a whole
(invariant 2), and entries a load or a disk write reads are pinned until it ends
(invariant 3). Index and tier bookkeeping happen under one lock; bytes are copied outside
it, into slots nobody else can see yet or out of pinned entries.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tiercache import failpoints
from tiercache.admission import admit, entry_values
from tiercache.buffers import WorkerBuffers, row_ids
from tiercache.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted
from tiercache.events import Change, EventLog
from tiercache.hashing import Keys, distinct_keys, key_array
from tiercache.index import Hit, Index
from tiercache.keymap import KeyMap
from tiercache.layout import Layout
from tiercache.metrics import Traffic, byte_counters, count_match, match_counters
from tiercache.movement import Group, Movement, Transfer
from tiercache.policy import PolicyConfig, make_policy
from tiercache.remote import RemoteTier, RemoteTierConfig, local_view
from tiercache.results import (EngineStats, Kind, LoadResult, Match, StopReason, StoreResult, Tier,
                               TierStats)
from tiercache.tiering import Tiering
from tiercache.tiers.arena import SlotArena
from tiercache.tiers.device import DeviceConfig, device_arena
from tiercache.tiers.disk import DiskConfig, DiskTier
from tiercache.tiers.host import HostConfig, host_arena
from tiercache.tiers.remote.store import open_store
from tiercache.transfer import CpuTransfer, CudaTransfer
from tiercache.tuning import AlphaTuner

_LOAD_ATTEMPTS = 4  # a damaged entry found during a load drops it and retries the load


@dataclass(frozen=True)
class EngineConfig:
    host: HostConfig = field(default_factory=HostConfig)
    disk: DiskConfig | None = None
    device: DeviceConfig | None = None  # a GPU arena above the host, for GPU workers
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # a str names the eviction only
    copy_threads: int = 2
    evict_slack: float = 0.01  # an eviction frees at least this share of the tier's budget
    remote: RemoteTierConfig | None = None  # a shared tier below the others (tiercache/remote.py)

    def __post_init__(self) -> None:
        if isinstance(self.policy, str):
            object.__setattr__(self, "policy", PolicyConfig(eviction=self.policy))


def _pages(buffers: WorkerBuffers, transfer: Transfer) -> Group:
    return Group(Kind.PAGE, buffers.paged, buffers.page_offsets, buffers.layout.page_bytes, transfer)


def _checkpoints(buffers: WorkerBuffers, transfer: Transfer) -> Group:
    return Group(Kind.CHECKPOINT, buffers.slots, buffers.slot_offsets,
                 buffers.layout.checkpoint_bytes, transfer)


Alive = Callable[[], bool]


def _checks(checks: np.ndarray | None, keys: np.ndarray) -> np.ndarray | None:
    """Checks as uint64, one per key, or None."""
    if checks is None:
        return None
    checks = np.asarray(checks, np.uint64).reshape(-1)
    if len(checks) != len(keys):
        raise InvalidArgument(f"got {len(checks)} checks for {len(keys)} keys: give one per key")
    return checks


class Engine:
    def __init__(self, config: EngineConfig, index: Index, host: SlotArena,
                 disk: DiskTier | None) -> None:
        self.config = config
        self.index = index
        self.host = host
        self.disk = disk
        self.transfer = CpuTransfer(config.copy_threads)
        self._cuda: dict[int, CudaTransfer] = {}  # one per GPU that workers use, made on demand
        self._lock = threading.RLock()
        self._inflight = (KeyMap(), KeyMap())  # by Kind: entries a store is writing now
        self._closing = self._closed = False
        self.counters: dict[str, int] = dict.fromkeys(
            ["matches", "matched_pages", "stored_pages", "stored_checkpoints", "skipped_pages",
             "skipped_checkpoints", "declined_checkpoints", "loads", "loaded_pages", "demoted",
             "disk_writes", "promoted", "prefetches", "promotion_waits", "copied_down", "regrets",
             # evictions: by the policy, by Evict calls, of damaged entries
             *(f"evicted_{tier}{why}" for tier in ("device", "host", "disk")
               for why in ("", "_by_request", "_damaged"))], 0)
        self.counters.update(match_counters())
        self.traffic = Traffic()  # bytes and copy times per hop
        policy = config.policy
        self.tuner = AlphaTuner(policy.alpha, self.counters) if policy.tune_alpha else None
        self.tiers = Tiering(index, host, disk, make_policy(policy), self.counters,
                             config.evict_slack, self._lock, self.tuner, self.traffic)
        self.moving = Movement(self.tiers, self.transfer, policy.writes, self._lock, self.counters)
        self.remote: RemoteTier | None = None
        self.events: EventLog | None = None  # KV events, once attached

    @classmethod
    def open(cls, config: EngineConfig = EngineConfig()) -> "Engine":
        """Allocate the tiers, rebuild the index from an existing disk directory, and start
        the background thread (disk writes and promotions) when there is a disk."""
        disk = DiskTier.open(config.disk) if config.disk else None
        engine = cls(config, Index(), host_arena(config.host), disk)
        if disk is not None:
            engine._rebuild(disk)
        engine.moving.start()
        if config.remote is not None:
            engine.remote = RemoteTier(config.remote, open_store(config.remote.store), engine.index,
                                       engine.host, engine._lock, engine.traffic)
            engine.remote.start()
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
                               nbytes, Tier.DISK, checks=np.array([r.check for r in batch], np.uint64))

    def drain(self) -> None:
        """Wait until the background work asked for so far is done: after a write-through
        store, its entries are on disk when this returns; so are promotions a match started."""
        with self._lock:
            self._check_open()
        self.moving.drain()
        if self.remote is not None:  # and, with a remote tier, the stores written to it
            self.remote.drain()

    def flush(self) -> int:
        """Write every host entry that is not on disk yet to disk (they stay in the host).
        Returns how many the background writer wrote meanwhile; without a disk tier, 0."""
        with self._lock:
            self._check_open()
        return self._flush()

    def _flush(self) -> int:
        if self.disk is None:
            return 0
        if self.tiers.device is not None:  # device entries go down through the host
            with self._lock:
                self.moving.stored_on_device(self.index.rows_in(Tier.DEVICE))
            self.moving.drain()
        with self._lock:
            before = self.counters["disk_writes"]
            self.moving.write_soon(self.tiers.dirty())
        self.moving.drain()
        with self._lock:
            return self.counters["disk_writes"] - before

    def close(self, flush: bool = True) -> None:
        """Flush the host tier to disk (unless told not to), stop the background thread and
        release everything. Calls made from now on fail: the index would name bytes that
        are gone. Stores still running when close begins are flushed too."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        try:
            while flush and self.disk is not None:
                with self._lock:
                    storing = any(len(m) for m in self._inflight)  # stores begun before close
                self._flush()
                if not storing:  # this flush came after the last of them published
                    break
                time.sleep(0.001)
        finally:
            if self.remote is not None:  # its writer reads host slots: before they go
                self.remote.close()
            self.moving.stop()
            with self._lock:
                for cuda in self._cuda.values():
                    cuda.close()  # waits for every copy in flight
                self.moving.reap()
                self.transfer.close()
                self.host.close()
                if self.disk is not None:
                    self.disk.close()
                self._closed = True

    def _check_open(self) -> None:
        if self._closing:
            raise FailedPrecondition("the engine is closed: open a new one with Engine.open")

    def _transfer_for(self, buffers: WorkerBuffers) -> Transfer:
        """The copy path for a worker's buffers, chosen by the device they live on. The
        first GPU that workers bring gets the device tier, if one is configured."""
        if buffers.device.type != "cuda":
            return self.transfer
        with self._lock:
            index = buffers.device.index or 0
            if index not in self._cuda:
                self._cuda[index] = CudaTransfer.open(buffers.device)
                if self.config.device is not None and self.tiers.device is None:
                    self.tiers.device = device_arena(self.config.device, buffers.device)
                    self.tiers.device_transfer = self._cuda[index]
                    self.moving.start()
            return self._cuda[index]

    def quiesce(self, buffers: WorkerBuffers) -> None:
        """Return once no copy of this engine touches `buffers` (before they are unmapped)."""
        transfer = self._transfer_for(buffers)
        transfer.synchronize()
        if isinstance(transfer, CudaTransfer):
            transfer.forget(buffers.paged)
            transfer.forget(buffers.slots)
        with self._lock:
            self.moving.reap()

    # -- store ------------------------------------------------------------------------
    def store(self, buffers: WorkerBuffers, keys: Keys, rows: Sequence[int] = (),
              checkpoints: Mapping[int, int] | None = None, ready: Any = None, *,
              checks: np.ndarray | None = None, alive: Alive | None = None,
              durable: bool = False, timeout: float | None = None,
              remote: bool = True) -> StoreResult:
        """Store a prompt after prefill: its KV pages (keys[i] from rows[i]; none for a
        layout without paged buffers) and, of the checkpoints offered, {pages: state slot}
        (each the state after that many pages), those the admission policy keeps. The
        result names the checkpoints now cached. On a GPU, copies start after `ready` (an
        event the worker recorded after writing the rows); the call returns when the
        worker may reuse its rows.

        `checks` (uint64, one per key, e.g. hashing.page_checks) go with the entries: a
        match must bring the same to hit them. `alive` says whether the caller still
        waits: once it does not, the worker may be writing its rows again, so a batch
        copied after that is dropped instead of published.

        `durable`: return only once every page of the chain and each checkpoint the result
        names are committed to disk (within `timeout` seconds); raise if they cannot be.
        `remote`: with a remote tier, write the entries there too, in the background
        (False keeps them local: a tenant or model configured to stay local)."""
        layout, chain = buffers.layout, distinct_keys(keys)
        checks = _checks(checks, chain)
        offered = dict(checkpoints or {})
        bad = [n for n in offered if not 0 < n <= len(chain)]
        if bad:
            raise InvalidArgument(f"checkpoint at page {bad[0]} is outside the prompt's "
                                  f"{len(chain)} full pages")
        if offered and not layout.needs_checkpoint:
            raise InvalidArgument("this layout has no slot buffers: offer no checkpoints")
        slots = dict(zip(offered, row_ids(list(offered.values()), layout.slot_rows,
                                          "state slot").tolist()))
        if layout.needs_pages:
            src = self._page_rows(layout, chain, rows)
        elif len(rows):
            raise InvalidArgument("this layout has no paged buffers: give no kv rows")
        with self._lock:
            self._check_open()
            shared = self._shared_pages(layout, chain)
        kept = admit(self.config.policy.admission, offered, len(chain), shared)
        with self._lock:
            self.counters["declined_checkpoints"] += len(offered) - len(kept)
        src = src if layout.needs_pages else None
        kept_slots = {n: slots[n] for n in kept.tolist()}
        if durable and self.disk is None:  # before any copying
            raise FailedPrecondition("durable stores need a disk tier: start the daemon with one")
        pins: list[np.ndarray] | None = [] if durable else None
        try:
            result = self._store_chain(buffers, chain, src, kept_slots, ready, checks, alive, pins)
            if durable:
                self._persist(buffers, chain, src, kept_slots, checks, alive, result, timeout, pins)
        finally:
            if pins:
                with self._lock:
                    self.index.unpin(np.concatenate(pins))
        if remote and self.remote is not None:
            self._write_remote(layout, chain, result)
        return result

    def store_pages(self, buffers: WorkerBuffers, keys: Keys, rows: Sequence[int],
                    ready: Any = None) -> StoreResult:
        """Store the KV pages of a prompt: keys[i] (page i+1 of the chain) from rows[i]."""
        if not buffers.layout.needs_pages:
            raise InvalidArgument("this layout has no paged buffers: store a checkpoint instead")
        chain = distinct_keys(keys)
        return self._store_chain(buffers, chain, self._page_rows(buffers.layout, chain, rows),
                                 {}, ready)

    def store_checkpoint(self, buffers: WorkerBuffers, keys: Keys, slot: int,
                         ready: Any = None) -> StoreResult:
        """Store the state in `slot`, taken after the last page of the chain `keys` (always:
        admission applies to the checkpoints `store` is offered)."""
        if not buffers.layout.needs_checkpoint:
            raise InvalidArgument("this layout has no slot buffers: it has no checkpoints")
        chain = distinct_keys(keys)
        if not len(chain):
            raise InvalidArgument("a checkpoint needs the page keys of its prefix, got none")
        src = row_ids([slot], buffers.layout.slot_rows, "state slot")
        return self._store_chain(buffers, chain, None, {len(chain): int(src[0])}, ready)

    def _persist(self, buffers: WorkerBuffers, chain: np.ndarray, src: np.ndarray | None,
                 slots: dict[int, int], checks: np.ndarray | None, alive: Alive | None,
                 stored: StoreResult, timeout: float | None, pins: list[np.ndarray]) -> None:
        """Commit the entries of a store to disk before it is acknowledged as durable. The
        store pinned what it published or found cached, so no other store evicts it now;
        entries another store was writing at the time are waited for, and stored again if
        it failed (the caller still waits, so its rows still hold them)."""
        if stored.skipped:
            raise ResourceExhausted(f"{stored.skipped} entries of the store found no room in "
                                    "memory, so they cannot be made durable: raise the budgets")
        depths = np.asarray(stored.checkpoints, np.int64)
        deadline = time.monotonic() + (30.0 if timeout is None else timeout)
        while True:
            failpoints.hit("store.before_persist")
            with self._lock:
                self._check_open()
                rows = np.concatenate([
                    self.index.rows_of(Kind.PAGE, chain) if src is not None else [],
                    self.index.rows_of(Kind.CHECKPOINT, chain[depths - 1])]).astype(np.int64)
                pinned = np.concatenate(pins) if pins else np.empty(0, np.int64)
                if np.all(np.isin(rows, pinned)):
                    break
            if time.monotonic() > deadline:
                raise DeadlineExceeded("entries of a durable store stayed in other stores' hands "
                                       "until the deadline: its entries may or may not be durable")
            time.sleep(0.001)  # others may still be writing them: store again what is missing
            self._store_chain(buffers, chain, src, {d: slots[d] for d in depths.tolist()},
                              None, checks, alive, pins)
        with self._lock:
            todo = rows[~self.index.in_tier(rows, Tier.DISK)]
            if self.tiers.device is not None:  # device-only entries go down first
                self.tiers.copy_down(todo[~self.index.in_tier(todo, Tier.HOST)])
        if not self.moving.write_and_wait(todo, None if timeout is None else deadline - time.monotonic()):
            raise DeadlineExceeded("the deadline passed before the store reached disk: "
                                   "its entries may or may not be durable")
        with self._lock:
            if not np.all(self.index.in_tier(rows, Tier.DISK)):
                raise ResourceExhausted("the disk tier could not take the store's entries: "
                                        "raise --disk-map-size or store without durable")

    def _page_rows(self, layout: Layout, chain: np.ndarray, rows: Sequence[int]) -> np.ndarray:
        src = row_ids(rows, layout.page_rows, "kv row")
        if len(src) != len(chain):
            raise InvalidArgument(f"got {len(chain)} page keys but {len(src)} kv rows: give one row per page")
        return src

    def _shared_pages(self, layout: Layout, chain: np.ndarray) -> int:
        """How many leading pages of the chain are cached (0 without paged buffers)."""
        if not layout.needs_pages:
            return 0
        missing = np.flatnonzero(self.index.rows_of(Kind.PAGE, chain) < 0)
        return int(missing[0]) if len(missing) else len(chain)

    def _store_chain(self, buffers: WorkerBuffers, chain: np.ndarray, src: np.ndarray | None,
                     offers: dict[int, int], ready: Any = None, checks: np.ndarray | None = None,
                     alive: Alive | None = None, pins: list[np.ndarray] | None = None) -> StoreResult:
        """Store the pages of a chain (if `src`) and checkpoints {pages: slot}, all under one
        stamp, each entry rated by what it saves (admission.entry_values)."""
        layout, depths = buffers.layout, np.array(sorted(offers), np.int64)
        with self._lock:
            self._check_open()
            stamp = self.index.tick()
            found = (self.index.rows_of(Kind.CHECKPOINT, chain) if layout.needs_checkpoint
                     else np.empty(0, np.int64))
        ends = np.union1d(np.flatnonzero(found >= 0) + 1, depths)
        page_values, end_values = entry_values(layout, len(chain), ends)
        transfer = self._transfer_for(buffers)
        result = StoreResult(0, 0, 0)
        if src is not None:
            result += self._store(_pages(buffers, transfer), chain, np.arange(1, len(chain) + 1),
                                  src, page_values, stamp, ready, checks, alive, pins)[0]
        elif layout.needs_pages and len(depths):  # the pages under a new checkpoint are worth more
            with self._lock:
                rows = self.index.rows_of(Kind.PAGE, chain)
                self.index.raise_values(rows[rows >= 0], page_values[rows >= 0])
        if len(depths):
            part, kept = self._store(_checkpoints(buffers, transfer), chain[depths - 1], depths,
                                     np.array([offers[d] for d in depths.tolist()], np.int64),
                                     end_values[np.searchsorted(ends, depths)], stamp, ready,
                                     None if checks is None else checks[depths - 1], alive, pins)
            result += StoreResult(part.stored, part.present, part.skipped,
                                  tuple(depths[kept].tolist()))
        return result

    def _store(self, group: Group, keys: np.ndarray, depths: np.ndarray, src: np.ndarray,
               values: np.ndarray, stamp: int, ready: Any, checks: np.ndarray | None = None,
               alive: Alive | None = None, pins: list[np.ndarray] | None = None
               ) -> tuple[StoreResult, np.ndarray]:
        """Store entries in the first tier: the device tier for workers on its GPU, else the
        host. Returns the result and which keys are cached now. With `pins`, the entries
        published or found cached are pinned (a durable store), each array appended."""
        group.transfer.wait_for(ready, "store")
        tier = Tier.DEVICE if group.transfer is self.tiers.device_transfer else Tier.HOST
        arena = self.tiers.arena(tier)
        todo, claimed, clashes = self._claim(group, keys, values, stamp, checks, pins)
        stored = 0
        try:
            while stored < len(todo):  # in batches: each one may push the last down a tier
                with self._lock:
                    slots = self.tiers.reserve(group.nbytes, len(todo) - stored, tier)
                if not slots and tier == Tier.DEVICE:  # too small, or pinned by loads: the host
                    tier, arena = Tier.HOST, self.host  # takes the rest
                    continue
                if not slots:
                    break
                batch = todo[stored:stored + len(slots)]  # shallow pages first
                try:
                    failpoints.hit("store.before_gather")
                    self._gather(group, src[batch], np.asarray(slots, np.int64), arena)
                    failpoints.hit("store.before_publish")
                    if alive is not None and not alive():
                        raise DeadlineExceeded("the call ended while its rows were being copied: "
                                               "the rest of the store was dropped")
                except BaseException:
                    with self._lock:
                        arena.free(group.nbytes, slots)
                    raise
                with self._lock:
                    rows = self.index.publish(group.kind, keys[batch], depths[batch], group.nbytes,
                                              tier, slots, stamp, values[batch],
                                              None if checks is None else checks[batch])
                    if pins is not None:
                        self.index.pin(rows)
                        pins.append(rows)
                    if tier == Tier.DEVICE:
                        self.moving.stored_on_device(rows)
                    else:
                        self.moving.stored(rows)
                stored += len(batch)
        finally:
            with self._lock:
                self._inflight[group.kind].delete(claimed)
                kind = "pages" if group.kind == Kind.PAGE else "checkpoints"
                self.counters["stored_" + kind] += stored
                self.counters["skipped_" + kind] += len(todo) - stored
        if len(todo) and not stored:
            raise ResourceExhausted(
                f"no room in the {tier.name.lower()} tier for a {group.nbytes}-byte entry (budget "
                f"{arena.budget_bytes} bytes, the rest pinned by loads): raise the "
                f"{tier.name.lower()} budget")
        kept = np.ones(len(keys), bool)
        kept[todo[stored:]] = False
        kept[clashes] = False
        skipped = len(todo) - stored + len(clashes)
        return StoreResult(stored, len(keys) - len(todo) - len(clashes), skipped), kept

    def _claim(self, group: Group, keys: np.ndarray, values: np.ndarray, stamp: int,
               checks: np.ndarray | None = None, pins: list[np.ndarray] | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Refresh the entries already cached; claim the others that no concurrent store is
        writing. Returns (positions of the claimed keys, the claimed keys, positions of keys
        cached for another prompt: a collision, left alone and not stored)."""
        kind = group.kind
        with self._lock:
            self._check_open()
            self.moving.reap()
            existing = self.index.rows_of(kind, keys)
            # an entry of another size or check under the key is not this caller's to use
            clashes = np.flatnonzero(self.index.usable(existing, group.nbytes, checks) != existing)
            existing[clashes] = -2  # neither present nor new
            present = existing >= 0
            self.index.touch(existing[present], stamp)
            self.index.raise_values(existing[present], values[present])
            if pins is not None:
                self.index.pin(existing[present])
                pins.append(existing[present])
            new = np.flatnonzero(existing == -1)
            self.tiers.returned(kind, keys[new])
            todo = new[self._inflight[kind].lookup(keys[new]) < 0]  # others are writing the rest
            self._inflight[kind].insert(keys[todo], todo)
            return todo, keys[todo], clashes

    def _gather(self, group: Group, src: np.ndarray, slots: np.ndarray, arena: SlotArena) -> None:
        """Copy worker rows into arena slots; returns once the worker may reuse the rows."""
        place = "device" if arena is self.tiers.device else "host"
        with self.traffic.timed("worker", place, len(src) * group.nbytes):
            group.transfer.gather(group.buffers, group.offsets, src,
                                  list(arena.pool(group.nbytes).parts(slots)))
            group.transfer.fence("store").synchronize()  # this batch only, not the device

    # -- match and load -----------------------------------------------------------------
    def match(self, layout: Layout, keys: Keys, prefetch: bool = False, *,
              checks: np.ndarray | None = None) -> Match:
        """The longest hybrid match of `keys` (of entries stored with the same `checks`,
        if given). With `prefetch`, the background thread starts promoting its disk entries
        to the host, so that the load that follows finds them there (a load of an entry
        still moving waits for it)."""
        chain = distinct_keys(keys)
        checks = _checks(checks, chain)
        with self._lock:
            hit = self._match(layout, chain, checks)
            if prefetch and hit.match.pages:
                self.counters["prefetches"] += self.moving.start_promotion(hit.rows)
            local = self._local_beyond(layout, chain, checks, hit.match)
        match = hit.match
        if local is not None:  # outside the lock: the remote tier answers within its budget
            extension = self.remote.extend(layout, chain, checks, local)
            match = match if extension is None else extension.match
        with self._lock:
            self.counters["matches"] += 1
            self.counters["matched_pages"] += match.pages
            count_match(self.counters, match, layout.page_tokens)
        return match

    def _match(self, layout: Layout, keys: np.ndarray, checks: np.ndarray | None = None) -> Hit:
        self._check_open()
        self.moving.reap()
        self.index.tick()
        hit = self.index.match(keys, layout.page_tokens, layout.page_bytes, layout.checkpoint_bytes,
                               checks)
        self.index.touch(hit.rows)
        return hit

    def load(self, buffers: WorkerBuffers, keys: Keys, rows: Sequence[int] = (),
             slot: int | None = None, ready: Any = None, asynchronous: bool = False, *,
             checks: np.ndarray | None = None) -> LoadResult:
        """Copy the longest hybrid match of `keys` (at most len(rows) pages) into `rows` and
        `slot`. Fails as a whole: a damaged entry is dropped and the load redone shorter.
        A load of entries a promotion is still moving waits for it.

        On a GPU, copies start after `ready` (an event the worker recorded after its last
        use of the rows). The call returns when the bytes are in place, or, if
        `asynchronous`, at once with `LoadResult.done`: an interprocess event the worker's
        stream waits on; the entries stay pinned until it completes. With `checks`, only
        entries stored with the same checks hit (see `store`)."""
        layout, keys = buffers.layout, distinct_keys(keys)
        checks = _checks(checks, keys)
        dst = row_ids(rows, layout.page_rows, "kv row", unique=True)
        limit = len(dst) if layout.needs_pages else len(keys)
        dst_slot = np.empty(0, np.int64)
        if layout.needs_checkpoint:
            if slot is None:
                raise InvalidArgument("this layout has slot buffers: give the state slot to load into")
            dst_slot = row_ids([slot], layout.slot_rows, "state slot")
        fetched = self._fetch_remote(layout, keys[:limit], None if checks is None else checks[:limit])
        try:
            return self._load(buffers, keys, checks, dst, dst_slot, limit, ready, asynchronous)
        finally:
            if len(fetched):
                with self._lock:
                    self.index.unpin(fetched)

    def _load(self, buffers: WorkerBuffers, keys: np.ndarray, checks: np.ndarray | None,
              dst: np.ndarray, dst_slot: np.ndarray, limit: int, ready: Any,
              asynchronous: bool) -> LoadResult:
        layout, damaged = buffers.layout, 0
        for _ in range(_LOAD_ATTEMPTS):
            with self._lock:
                hit = self._match(layout, keys[:limit], None if checks is None else checks[:limit])
                if hit.match.pages == 0:
                    return LoadResult(hit.match, {}, damaged)
                self.index.pin(hit.rows)
            transfer = self._transfer_for(buffers)
            transfer.wait_for(ready, "load")
            moves = [(_pages(buffers, transfer), hit.page_rows, dst[:hit.match.pages])]
            if hit.checkpoint_row is not None:
                moves.append((_checkpoints(buffers, transfer), np.array([hit.checkpoint_row]),
                              dst_slot))
            done = self.moving.deliver(hit.rows, moves, transfer, asynchronous)
            damaged += done.damaged
            if not done.damaged:
                with self._lock:
                    self.counters["loads"] += 1
                    self.counters["loaded_pages"] += hit.match.pages
                return LoadResult(hit.match, done.bytes_from, damaged, done.event)
        return LoadResult(Match(0, 0, len(keys), b"", None, StopReason.MISSING_PAGE), {}, damaged)

    def prefetch(self, layout: Layout, keys: Keys, wait: bool = True) -> int:
        """Copy the disk-only entries of the hybrid match of `keys` into the host tier, so a
        load that follows finds them there. Returns how many entries moved, or, without
        `wait`, how many the background thread was asked to move."""
        with self._lock:
            hit = self._match(layout, distinct_keys(keys))
            if self.disk is None or hit.match.pages == 0:
                return 0
            if not wait:
                return self.moving.start_promotion(hit.rows)
            self.index.pin(hit.rows)
        moves = [(Group(Kind.PAGE, (), [], layout.page_bytes, self.transfer), hit.page_rows, None)]
        if hit.checkpoint_row is not None:
            moves.append((Group(Kind.CHECKPOINT, (), [], layout.checkpoint_bytes, self.transfer),
                          np.array([hit.checkpoint_row]), None))
        return self.moving.deliver(hit.rows, moves, self.transfer).promoted

    def evict(self, keys: Keys | None = None, tier: Tier | None = None) -> int:
        """Drop the pages and checkpoints named by `keys` (all entries if None) from `tier`
        (every tier if None); entries a load is reading stay. Evicting from the device tier
        alone moves entries down: those without a host copy get one first. Returns how
        many entries were dropped from at least one tier."""
        present = [Tier.DEVICE] * (self.tiers.device is not None) + [Tier.HOST, Tier.DISK]
        tiers = [t for t in present if tier is None or t == tier]
        if tiers == [Tier.DEVICE]:
            self.moving.drain()  # copies down in flight end first (they pin what they read)
        with self._lock:
            self._check_open()
            self.moving.reap()  # asynchronous loads that are done no longer pin their entries
            if keys is None:
                rows = np.unique(np.concatenate([self.index.rows_in(t) for t in tiers]))
            else:
                found = np.concatenate([self.index.rows_of(kind, distinct_keys(keys)) for kind in Kind])
                rows = np.unique(found[found >= 0])
            rows = rows[self.index.column("pins", rows) == 0]
            dropped = np.zeros(len(rows), bool)
            for t in tiers:
                inside = self.index.in_tier(rows, t)
                dropped |= inside
                if inside.any():
                    if tiers == [Tier.DEVICE]:
                        self.counters["copied_down"] += self.tiers.copy_down(rows[inside])
                    self.tiers.remove(rows[inside], t)
                    self.counters[f"evicted_{t.name.lower()}_by_request"] += int(inside.sum())
            return int(dropped.sum())

    # -- the remote tier and KV events (issue 17): kept apart, to move with the core -------
    def _local_beyond(self, layout: Layout, chain: np.ndarray, checks: np.ndarray | None,
                      hit: Match):
        """What the local tiers hold of a prompt whose local hit stops short, for the
        remote tier to extend; None without a remote tier or when nothing is missing.
        Call under the lock."""
        if self.remote is None or hit.stop is StopReason.END_OF_PROMPT:
            return None
        return local_view(self.index, layout, chain, checks, hit)

    def _fetch_remote(self, layout: Layout, chain: np.ndarray, checks: np.ndarray | None) -> np.ndarray:
        """Bring the remote part of a prompt's match into host slots before a load; returns
        the rows, pinned until the load ends."""
        if self.remote is None:
            return np.empty(0, np.int64)
        with self._lock:
            hit = self._match(layout, chain, checks)
            local = self._local_beyond(layout, chain, checks, hit.match)
        extension = None if local is None else self.remote.extend(layout, chain, checks, local)
        if extension is None:
            return np.empty(0, np.int64)
        rows = self.remote.fetch(extension, chain, layout,
                                 lambda nbytes, count: self.tiers.reserve(nbytes, count))
        with self._lock:
            self.moving.stored(rows)  # host entries now: on to disk as the policy says
        return rows

    def _write_remote(self, layout: Layout, chain: np.ndarray, result: StoreResult) -> None:
        """Queue a store's entries for the remote tier (skipped there if present)."""
        assert self.remote is not None
        if layout.needs_pages:
            self.remote.write_soon(Kind.PAGE, chain)
        if result.checkpoints:
            self.remote.write_soon(Kind.CHECKPOINT, chain[np.array(result.checkpoints) - 1])

    def attach_events(self, events: EventLog) -> None:
        """Record every entry entering or leaving a tier (the remote one included) in
        `events`, for KV event publishing."""
        def observe(added: bool, kinds: np.ndarray, tier: Tier, keys: np.ndarray) -> None:
            events.record_tier(Change.STORED if added else Change.REMOVED, kinds, tier, keys)
        with self._lock:
            self.index.observer = observe
            self.events = events
            if self.remote is not None:
                self.remote.events = events

    def stats(self) -> EngineStats:
        with self._lock:
            tiers = [TierStats(Tier.HOST, self.index.count[Tier.HOST], self.host.used_bytes,
                               self.host.budget_bytes)]
            if self.tiers.device is not None:
                tiers.insert(0, TierStats(Tier.DEVICE, self.index.count[Tier.DEVICE],
                                          self.tiers.device.used_bytes, self.tiers.device.budget_bytes))
            if self.disk is not None:
                tiers.append(TierStats(Tier.DISK, self.index.count[Tier.DISK], self.disk.used_bytes,
                                       self.disk.budget_bytes))
            counters = {**self.counters, **byte_counters(self.traffic.snapshot())}
            counters["checksum_failures"] = self.disk.checksum_failures if self.disk else 0
            counters["disk_moved_aside"] = int(self.disk is not None and self.disk.moved_aside is not None)
            counters["collisions"] = self.index.collisions
            counters["foreign_entries"] = self.index.foreign
            counters["disk_write_errors"] = self.disk.write_errors if self.disk else 0
            if self.remote is not None:
                counters.update(self.remote.stats())
            if self.events is not None:
                counters.update(kv_event_batches=self.events.batches,
                                kv_events_dropped=self.events.dropped)
            alpha = getattr(self.tiers.policy, "alpha", None)
            return EngineStats(tuple(tiers), counters, alpha)
