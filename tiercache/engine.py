"""The embedded engine: the thin front of the cache (open, close, flush; match, load,
store, prefetch, evict, stats).

Where things are: the books (books.py) own what is where and the one lock; the paths
move bytes outside it: stores (store.py), loads (load.py), promotions (promotions.py),
and the background thread with the moves between tiers (background.py). The index only
ever shows committed bytes (invariant 1), a load delivers its whole match or fails as a
whole (invariant 2), and entries a load or a move reads are pinned until it ends
(invariant 3). A store may reply before its copies are done and publish after
(store.py); every call here first settles the stores that replied before it began.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from tiercache import trace
from tiercache.background import Background, Mover
from tiercache.books import Books
from tiercache.buffers import WorkerBuffers, row_ids
from tiercache.chores import ChoreStats, watched
from tiercache.errors import InvalidArgument
from tiercache.hashing import Keys, distinct_keys, key_array
from tiercache.index import ANY_TIER, Index
from tiercache.joint import Member
from tiercache.load import Group, Loads
from tiercache.metrics import Traffic
from tiercache.policy import PolicyConfig, make_policy
from tiercache.promotions import Promotions
from tiercache.events import Change, EventLog
from tiercache.remote import Extension, RemoteTier, RemoteTierConfig
from tiercache.results import EngineStats, Kind, LoadResult, Match, StopReason, StoreResult, Tier
from tiercache.store import ALL_SCOPES, Stores, StoreJob, checks_of, page_rows
from tiercache.tiers.arena import SlotArena
from tiercache.tiers.device import DeviceConfig, device_arena
from tiercache.tiers.disk import DiskConfig, DiskTier
from tiercache.tiers.host import HostConfig, host_arena
from tiercache.tiers.remote.adapters import open_store
from tiercache.transfer import CpuTransfer, CudaTransfer, Transfer
from tiercache.tuning import AlphaTuner


@dataclass(frozen=True)
class EngineConfig:
    host: HostConfig = field(default_factory=HostConfig)
    disk: DiskConfig | None = None
    device: DeviceConfig | None = None  # a GPU arena above the host, for GPU workers
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    copy_threads: int = 2
    evict_slack: float = 0.01  # an eviction frees at least this share of the tier's budget
    remote: RemoteTierConfig | None = None  # a shared tier below the others (tiercache/remote.py)

    def __post_init__(self) -> None:
        if not isinstance(self.policy, PolicyConfig):
            raise InvalidArgument(f"EngineConfig.policy must be a PolicyConfig, got "
                                  f"{type(self.policy).__name__}: e.g. PolicyConfig(eviction='lru')")


class Engine:
    def __init__(self, config: EngineConfig, index: Index, host: SlotArena,
                 disk: DiskTier | None) -> None:
        self.config = config
        policy = config.policy
        tuner = AlphaTuner(policy.alpha) if policy.tune_alpha else None
        self.books = Books(index, host, disk, make_policy(policy), config.evict_slack, tuner)
        self.traffic = Traffic()  # bytes and copy times per hop
        self.transfer = CpuTransfer(config.copy_threads)
        self._cuda: dict[int, CudaTransfer] = {}  # one per GPU that workers use, made on demand
        self.mover = Mover(self.books, self.traffic)
        self.promotions = Promotions(self.books, self.mover)
        self.background = Background(self.books, self.mover, policy.writes, self.promotions.run_one)
        self.loads = Loads(self.books, self.mover, self.promotions, self.traffic)
        self.stores = Stores(self.books, self.mover, self.background, self.traffic, policy.admission)
        self.remote: RemoteTier | None = None
        self.events: EventLog | None = None  # KV events, once attached
        self.rebuilt = ChoreStats()  # the index rebuilt from disk at open
        self.flushed = ChoreStats()  # host entries flushed to disk (at close)

    @property
    def index(self) -> Index:
        return self.books.index

    @property
    def host(self) -> SlotArena:
        return self.books.host

    @property
    def disk(self) -> DiskTier | None:
        return self.books.disk

    @classmethod
    def open(cls, config: EngineConfig = EngineConfig()) -> "Engine":
        """Allocate the tiers, rebuild the index from an existing disk directory, and start
        the background thread (disk writes and promotions) when there is a disk."""
        disk = DiskTier.open(config.disk) if config.disk else None
        engine = cls(config, Index(), host_arena(config.host), disk)
        if disk is not None:
            engine._rebuild(disk)
        engine._start_background()
        if config.remote is not None:
            engine.remote = RemoteTier(config.remote, open_store(config.remote.store), engine.books,
                                       engine.traffic)
            engine.remote.start()
            if config.remote.writes == "evict":
                engine.books.room.hand_off = True
                engine.mover.hand_off = engine.remote.hand_off
        return engine

    def _start_background(self) -> None:
        self.background.start()
        self.promotions.accepting = self.background.running

    def _rebuild(self, disk: DiskTier) -> None:
        """Index what the disk holds, oldest first, one stamp per original write: every
        header is read, then indexed (progress counts headers read, then entries indexed)."""
        reading, indexed = True, 0
        with watched(self.rebuilt, f"rebuilding the index from the disk tier at {disk.config.path}",
                     disk.headers(), lambda: disk.scanned if reading else indexed):
            records = disk.scan()
            reading = False
            batches = groupby(records, key=lambda r: (r.created_ns, r.kind, r.nbytes))
            created, stamp = None, 0
            for (when, kind, nbytes), group in batches:
                if when != created:
                    created, stamp = when, self.index.tick()
                batch = list(group)
                self.books.publish(kind, key_array([r.key for r in batch]),
                                   np.array([r.depth for r in batch]), nbytes, Tier.DISK, None, stamp,
                                   checks=np.array([r.check for r in batch], np.uint64))
                indexed += len(batch)

    # -- lifetime ---------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait until the background work asked for so far is done: after a write-through
        store, its entries are on disk when this returns; so are promotions a match started."""
        self.books.check_open()
        self.stores.publishing.settle()
        self.background.drain()
        if self.remote is not None:  # and, with a remote tier, the stores written to it
            self.remote.drain()

    def flush(self) -> int:
        """Write every host entry that is not on disk yet to disk (they stay in the host).
        Returns how many the background writer wrote meanwhile; without a disk tier, 0."""
        self.books.check_open()
        self.stores.publishing.settle()
        return self._flush()

    def _flush(self) -> int:
        if self.disk is None:
            return 0
        if self.books.device is not None:  # device entries go down through the host
            self.background.stored_on_device(self.books.index_rows(Tier.DEVICE))
            self.background.drain()
        before, dirty = self.books.counters.disk_writes, self.books.dirty()
        # a flush with nothing to write (the second one of a close) is no news
        with watched(self.flushed, "flushing the host tier to disk", len(dirty),
                     lambda: self.books.counters.disk_writes - before,
                     logging.INFO if len(dirty) else logging.DEBUG):
            self.background.write_soon(dirty)
            self.background.drain()
        return self.books.counters.disk_writes - before

    def close(self, flush: bool = True) -> None:
        """Flush the host tier to disk (unless told not to), stop the background thread and
        release everything. Calls made from now on fail: the index would name bytes that
        are gone. Stores still running when close begins are flushed too."""
        with self.books.lock:
            if self.books.closing:
                return
            self.books.closing = True
        try:
            while flush and self.disk is not None:
                storing = self.books.storing()  # stores begun before close
                self._flush()
                if not storing:  # this flush came after the last of them published
                    break
                time.sleep(0.001)
        finally:
            self.stores.publishing.close()  # stores that replied publish before the background stops
            if self.remote is not None:  # its writer reads host slots: before they go
                self.remote.close()
            self.background.stop()
            self.promotions.stop()
            for cuda in self._cuda.values():
                cuda.close()  # waits for every copy in flight
            self.loads.reap()
            self.transfer.close()
            self.host.close()
            if self.disk is not None:
                self.disk.close()

    def _transfer_for(self, buffers: WorkerBuffers) -> Transfer:
        """The copy path for a worker's buffers, chosen by the device they live on. The
        first GPU that workers bring gets the device tier, if one is configured. A worker
        anywhere else reads device entries from their host copies: from its first call
        on, stores are copied down at once (Background.copy_down_at_once)."""
        if buffers.device.type != "cuda":
            transfer = self.transfer
        else:
            with self.books.lock:  # one transfer per GPU, made once
                index = buffers.device.index or 0
                if index not in self._cuda:
                    self._cuda[index] = CudaTransfer.open(buffers.device)
                    if self.config.device is not None and self.books.device is None:
                        self.books.attach_device(device_arena(self.config.device, buffers.device,
                                                              self._cuda[index].streams))
                        self.mover.device_transfer = self._cuda[index]
                        self._start_background()
                transfer = self._cuda[index]
        if transfer is not self.mover.device_transfer:
            self.background.copy_down_at_once()
        return transfer

    def prepare(self, buffers: WorkerBuffers) -> None:
        """Ready the copies of a worker's buffers before its first call: on a GPU, build
        their tables and load the kernels that copy them, which waits for the copies
        queued on that GPU (at registration, rather than in the worker's first store or
        load, behind its own queued work)."""
        self.books.check_open()
        transfer = self._transfer_for(buffers)
        for rows, offsets in ((buffers.paged, buffers.page_offsets),
                              (buffers.slots, buffers.slot_offsets)):
            if rows:
                transfer.prepare(rows, offsets)

    def quiesce(self, buffers: WorkerBuffers) -> None:
        """Return once no copy of this engine touches `buffers` (before they are unmapped).
        Stores that replied need not be completed for that (their copies are what touches
        the buffers): their scope's thread or next call completes them."""
        transfer = self._transfer_for(buffers)
        transfer.synchronize()
        transfer.forget(buffers.paged)
        transfer.forget(buffers.slots)
        self.loads.reap()

    # -- store --------------------------------------------------------------------------------
    def store(self, buffers: WorkerBuffers, keys: Keys, rows: Sequence[int] = (),
              checkpoints: Mapping[int, int] | None = None, ready: Any = None, *,
              checks: np.ndarray | None = None, alive: Callable[[], bool] | None = None,
              durable: bool = False, timeout: float | None = None,
              remote: bool = True, first_page: int = 0, done_event: Any = None,
              scope: Hashable = None) -> StoreResult:
        """Store a prompt after prefill: its KV pages (keys[i] from rows[i]; none for a
        layout without paged buffers) and, of the checkpoints offered, {pages: state slot}
        (each the state after that many pages), those the admission policy keeps. The
        result names the checkpoints now cached. On a GPU, copies start after `ready` (an
        event the worker recorded after writing the rows); the call returns when the
        worker may reuse its rows. With `done_event` (an event of the worker's, not
        for a durable store), it returns once the copies are queued and records the event
        after them: the worker's stream waits on it before it writes the rows again. The
        entries are published when the copies are done, before any later call to this
        engine of the same `scope` begins (store.py; the daemon's scope is the tenant).

        `first_page`: the keys are pages first_page+1.. of the prompt, after a hit of
        first_page pages that ends at a checkpoint (a store that adds to what a load
        brought sends only what it adds); checkpoints still count pages from the start.

        `checks` (uint64, one per key, e.g. hashing.page_checks) go with the entries: a
        match must bring the same to hit them. `alive` says whether the caller still
        waits: once it does not, the worker may be writing its rows again, so a batch
        copied after that is dropped instead of published.

        `durable`: return only once every page of the chain and each checkpoint the result
        names are committed to disk (within `timeout` seconds); raise if they cannot be.
        `remote`: with a remote tier, write the entries there too, in the background
        (False keeps them local: a tenant or model configured to stay local).

        `first_page`: the keys are pages first_page+1.. of the prompt (a store that adds to
        a hit sends only what it adds; see Worker.store); checkpoints still count pages from
        the start of the prompt."""
        self.stores.publishing.settle(scope)
        with trace.span("prepare"):
            job = self.stores.job(buffers, keys, rows, checkpoints, self._transfer_for(buffers), ready,
                                  checks, alive, durable, first_page,
                                  shared=remote and self.remote is not None, done=done_event,
                                  scope=scope)
        result = self.stores.store(job, timeout)
        if job.shared and self.remote.config.writes == "through":
            if buffers.layout.needs_pages:
                self.remote.write_soon(Kind.PAGE, job.chain)
            if result.checkpoints:
                self.remote.write_soon(Kind.CHECKPOINT,
                                       job.chain[np.array(result.checkpoints) - first_page - 1])
        return result

    def store_pages(self, buffers: WorkerBuffers, keys: Keys, rows: Sequence[int],
                    ready: Any = None) -> StoreResult:
        """Store the KV pages of a prompt: keys[i] (page i+1 of the chain) from rows[i]."""
        if not buffers.layout.needs_pages:
            raise InvalidArgument("this layout has no paged buffers: store a checkpoint instead")
        self.stores.publishing.settle()
        chain = distinct_keys(keys)
        job = StoreJob(buffers, chain, page_rows(buffers, chain, rows), {},
                       self._transfer_for(buffers), ready)
        return self.stores.store(job)

    def store_checkpoint(self, buffers: WorkerBuffers, keys: Keys, slot: int,
                         ready: Any = None) -> StoreResult:
        """Store the state in `slot`, taken after the last page of the chain `keys` (always:
        admission applies to the checkpoints `store` is offered)."""
        if not buffers.layout.needs_checkpoint:
            raise InvalidArgument("this layout has no slot buffers: it has no checkpoints")
        self.stores.publishing.settle()
        chain = distinct_keys(keys)
        if not len(chain):
            raise InvalidArgument("a checkpoint needs the page keys of its prefix, got none")
        src = row_ids([slot], buffers.layout.slot_rows, "state slot")
        job = StoreJob(buffers, chain, None, {len(chain): int(src[0])}, self._transfer_for(buffers),
                       ready)
        return self.stores.store(job)

    # -- match, load, prefetch, evict ---------------------------------------------------------
    def match(self, layout: Any, keys: Keys, prefetch: bool = False, *,
              checks: np.ndarray | None = None, scope: Hashable = None,
              buffers: WorkerBuffers | None = None) -> Match:
        """The longest hybrid match of `keys` (of entries stored with the same `checks`,
        if given). With `prefetch`, the background thread starts promoting its disk entries
        to the host, so that the load that follows finds them there (a load of an entry
        still moving waits for it). Every call sees the entries of the stores of its
        `scope` that replied before it (`store`). Given the caller's `buffers`, it counts
        only what that worker's load would read (Mover.readable)."""
        self.stores.publishing.settle(scope)
        chain = distinct_keys(keys)
        checks = checks_of(checks, chain)
        self.loads.reap()
        readable = ANY_TIER if buffers is None else self.mover.readable(self._transfer_for(buffers))
        hit = self.books.match(layout, chain, checks, readable=readable)
        if prefetch and hit.match.pages:
            self._prefetch_in_background(hit.rows)
        extension = self._remote_extension(layout, chain, checks, hit.match)
        match = hit.match if extension is None else extension.match
        self.books.count_match(match, layout.page_tokens)
        return match

    def match_group(self, members: Sequence[tuple[Any, Keys]], prefetch: bool = False, *,
                    checks: np.ndarray | None = None, scope: Hashable = None) -> Match:
        """The longest prefix that every member of a group can load (tiercache.joint):
        each member's layout and its keys for the same prompt (same page size)."""
        self.stores.publishing.settle(scope)
        parts = [Member(distinct_keys(keys), layout.page_bytes, layout.checkpoint_bytes)
                 for layout, keys in members]
        self.loads.reap()
        page_tokens = members[0][0].page_tokens
        hit = self.books.match_group(parts, page_tokens, checks_of(checks, parts[0].keys))
        self.books.count_match(hit.match, page_tokens)
        if prefetch and hit.match.pages:
            self._prefetch_in_background(hit.rows)
        return hit.match

    def _prefetch_in_background(self, rows: np.ndarray) -> int:
        started = self.promotions.start(rows)
        self.books.count("prefetches", started)
        if started:
            self.background.kick()
        return started

    def load(self, buffers: WorkerBuffers, keys: Keys, rows: Sequence[int] = (),
             slot: int | None = None, ready: Any = None, asynchronous: bool = False, *,
             checks: np.ndarray | None = None, done_event: Any = None,
             alive: Callable[[], bool] | None = None, scope: Hashable = None) -> LoadResult:
        """Copy the longest hybrid match of `keys` (at most len(rows) pages) into `rows` and
        `slot`. Fails as a whole: a damaged entry is dropped and the load redone shorter.
        A load of entries a promotion is still moving waits for it.

        On a GPU, copies start after `ready` (an event the worker recorded after its last
        use of the rows). The call returns when the bytes are in place, or, if
        `asynchronous`, at once with `LoadResult.done`: an interprocess event the worker's
        stream waits on (`done_event`, if the caller gives one to record again, instead of a
        new interprocess event); the entries stay pinned until the copies are done.
        With `checks`, only entries stored with the same checks hit (see `store`). `alive`
        says whether the caller still waits: once it does not, it may be writing its rows
        itself, so a load that gets to its copies after that raises instead."""
        self.stores.publishing.settle(scope)
        keys, layout = distinct_keys(keys), buffers.layout
        checks = checks_of(checks, keys)
        fetched = np.empty(0, np.int64)
        if self.remote is not None:  # remote hits come into host slots first, pinned
            limit = len(rows) if layout.needs_pages else len(keys)
            part, part_checks = keys[:limit], None if checks is None else checks[:limit]
            hit = self.books.match(layout, part, part_checks)
            extension = self._remote_extension(layout, part, part_checks, hit.match)
            if extension is not None:
                fetched = self.remote.fetch(extension, part, layout)
                self.background.stored(fetched)  # host entries now: on to disk as the policy says
        try:
            return self.loads.load(buffers, keys, rows, slot, self._transfer_for(buffers), ready,
                                   asynchronous, checks, done_event, alive)
        finally:
            if len(fetched):
                self.books.unpin(fetched)

    def prefetch(self, layout: Any, keys: Keys, wait: bool = True, *, scope: Hashable = None) -> int:
        """Copy the disk-only entries of the hybrid match of `keys` into the host tier, so a
        load that follows finds them there. Returns how many entries moved, or, without
        `wait`, how many the background thread was asked to move."""
        self.stores.publishing.settle(scope)
        hit = self.books.match(layout, distinct_keys(keys), pin=wait)
        if self.disk is None or hit.match.pages == 0:
            if wait and hit.match.pages:
                self.books.unpin(hit.rows)
            return 0
        if not wait:
            started = self.promotions.start(hit.rows)
            self.background.kick()
            return started
        jobs = [(Group(Kind.PAGE, (), [], layout.page_bytes, self.transfer),
                 self.books.disk_only(hit.page_rows), None)]
        if hit.checkpoint_row is not None:
            jobs.append((Group(Kind.CHECKPOINT, (), [], layout.checkpoint_bytes, self.transfer),
                         self.books.disk_only(np.array([hit.checkpoint_row])), None))
        return self.loads.deliver(hit.rows, jobs, self.transfer).promoted

    def evict(self, keys: Keys | None = None, tier: Tier | None = None, *,
              scope: Hashable = None) -> int:
        """Drop the pages and checkpoints named by `keys` (all entries if None: those of
        every scope's stores) from `tier` (every tier if None); entries a load is reading
        stay. Evicting from the device tier alone moves entries down: those without a host
        copy get one first. Returns how many entries were dropped from at least one tier."""
        self.stores.publishing.settle(ALL_SCOPES if keys is None else scope)
        present = [Tier.DEVICE] * (self.books.device is not None) + [Tier.HOST, Tier.DISK]
        tiers = [t for t in present if tier is None or t == tier]
        if tiers == [Tier.DEVICE]:
            self.background.drain()  # copies down in flight end first (they pin what they read)
        self.loads.reap()  # asynchronous loads that are done no longer pin their entries
        rows = None if keys is None else self.books.rows_named(distinct_keys(keys))
        dropped, displaced = self.books.evict(rows, tiers)
        self.mover.settle(displaced)
        return dropped

    def stats(self, scope: Hashable = ALL_SCOPES) -> EngineStats:
        """The tiers' figures and the counters, with the stores of `scope` that replied
        before this call completed (NO_SCOPE: none waited for, as a metrics scrape)."""
        self.stores.publishing.settle(scope)
        stats = self.books.stats(self.traffic.snapshot())
        if self.remote is not None:
            stats.counters.update(self.remote.stats())
        if self.events is not None:
            stats.counters.update(kv_event_batches=self.events.batches,
                                  kv_events_dropped=self.events.dropped)
        return stats

    # -- the remote tier and KV events -------------------------------------------------------
    def _remote_extension(self, layout: Any, chain: np.ndarray, checks: np.ndarray | None,
                          hit: Match) -> Extension | None:
        """What the remote tier adds beyond a local hit that stops short; None without a
        remote tier or when it adds nothing (it answers within its lookup budget)."""
        if self.remote is None or hit.stop is StopReason.END_OF_PROMPT:
            return None
        return self.remote.extend(layout, chain, checks, self.remote.local(layout, chain, checks, hit))

    def attach_events(self, events: EventLog) -> None:
        """Record every entry entering or leaving a tier (the remote one included) in
        `events`, for KV event publishing."""
        def observe(added: bool, kinds: np.ndarray, tier: Tier, keys: np.ndarray) -> None:
            events.record_tier(Change.STORED if added else Change.REMOVED, kinds, tier, keys)
        self.books.observe(observe)
        self.events = events
        if self.remote is not None:
            self.remote.events = events
