"""The load path: the longest hybrid match copied from the best tier into a worker's rows.

A load pins its hit (invariant 3), finds each entry (promotions.locate): device entries
go to workers on the device tier's GPU device to device, host entries are scattered
straight from their slots, disk entries are read into new host slots (promoted) or a
staging buffer first. It fails as a whole (invariant 2): an entry found damaged on disk
is dropped and the load is redone shorter. An asynchronous (GPU) load replies with an
event and keeps its entries pinned until the event completes (`reap`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from tiercache import failpoints, trace
from tiercache.background import Mover
from tiercache.books import Books
from tiercache.buffers import WorkerBuffers, row_ids
from tiercache.errors import DeadlineExceeded, InvalidArgument
from tiercache.hashing import Keys
from tiercache.metrics import Traffic
from tiercache.promotions import Placed, Promotions
from tiercache.results import Kind, LoadResult, Match, StopReason, Tier
from tiercache.tiers.arena import SlabPart, SlotPool
from tiercache.transfer import Transfer

_ATTEMPTS = 4  # a damaged entry found during a load drops it and retries the load
# A load of this many bytes of pages or more from below the device tier, and a store of
# this many bytes of entries into the host tier (store._parts), are queued in parts that
# grow (growing_parts): the first small, so that the GPU copies it while the daemon still
# plans the rest (most of a large call's CPU comes before its first copy).
SPLIT_BYTES = 128 << 20
# A large load's first part: an eighth of its pages. With a sixteenth, the link idled
# 0.1-0.4 ms between the first part's copy and the second's, which the daemon was still
# queuing (512 MiB in 16 KiB rows, H200, RESULTS.md, the thirtieth round of issue 15).
_FIRST_LOAD_PART = 8


@dataclass(frozen=True)
class Group:
    """One kind of entry moving between the worker and the tiers."""

    kind: Kind
    buffers: tuple[torch.Tensor, ...]
    offsets: list[int]
    nbytes: int
    transfer: Transfer  # the copy path of the worker's device

    @classmethod
    def pages(cls, buffers: WorkerBuffers, transfer: Transfer) -> "Group":
        return cls(Kind.PAGE, buffers.paged, buffers.page_offsets, buffers.layout.page_bytes, transfer)

    @classmethod
    def checkpoints(cls, buffers: WorkerBuffers, transfer: Transfer) -> "Group":
        return cls(Kind.CHECKPOINT, buffers.slots, buffers.slot_offsets,
                   buffers.layout.checkpoint_bytes, transfer)


@dataclass
class Delivery:
    bytes_from: dict[Tier, int] = field(default_factory=dict)
    damaged: list[int] = field(default_factory=list)
    promoted: int = 0
    event: Any = None  # asynchronous loads: the event that marks the copies done
    own: Any = None  # the same mark on an event no other process holds (what reap asks)
    staging: list[torch.Tensor] = field(default_factory=list)  # must outlive the copies
    moves: list = field(default_factory=list)  # (Located, entry size) of what this load promotes


Job = tuple[Group, np.ndarray, np.ndarray | None]  # entries' rows, destination rows (or none)


def growing_parts(count: int, first: int) -> list[slice]:
    """Slices covering range(count) in order: `first` items (at least one), then each
    part twice the one before, the last taking the rest once it is under twice that."""
    parts, start, size = [], 0, max(1, first)
    while start < count:
        end = count if count - start < 2 * size else start + size
        parts.append(slice(start, end))
        start, size = end, size * 2
    return parts


def _split(match: Match, page_bytes: int) -> list[slice]:
    """The parts a load's pages are queued in (SPLIT_BYTES)."""
    below = len(match.tier_codes) - match.tier_codes.count(Tier.DEVICE)
    if below * page_bytes < SPLIT_BYTES:
        return [slice(0, match.pages)]
    return growing_parts(match.pages, match.pages // _FIRST_LOAD_PART)


def _parts(pool: SlotPool, slots: np.ndarray, where: np.ndarray) -> list[SlabPart]:
    """The pool's parts of the entries `where` marks among a load's entries (`slots` are
    theirs, in order), with positions among all the entries."""
    parts = list(pool.parts(slots))
    if len(slots) == len(where):  # every entry, the usual case: the positions stand
        return parts
    at = np.flatnonzero(where)
    return [SlabPart(p.slab, p.local, at[p.positions]) for p in parts]


class Loads:
    def __init__(self, books: Books, mover: Mover, promotions: Promotions, traffic: Traffic) -> None:
        self.books = books
        self.mover = mover
        self.promotions = promotions
        self.traffic = traffic
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, np.ndarray, list[torch.Tensor]]] = []  # async loads
        # the last interprocess events handed out: a worker may open one after its copy is
        # done, and an exported event must still exist then
        self._handed_out: deque = deque(maxlen=1024)

    def reap(self, spare: Any = None) -> None:
        """Unpin the entries of asynchronous loads whose copies have finished, but those of
        the load whose own mark is `spare` (one just queued: pinned until a later call)."""
        finished, waiting = [], []
        with self._lock:
            for pending in self._pending:
                (finished if pending[0] is not spare and pending[0].query() else waiting).append(pending)
            self._pending = waiting
        for _, rows, _ in finished:
            self.books.unpin(rows)

    def load(self, buffers: WorkerBuffers, keys: Keys, rows: Any, slot: int | None,
             transfer: Transfer, ready: Any, asynchronous: bool,
             checks: np.ndarray | None, done_event: Any = None,
             alive: Callable[[], bool] | None = None) -> LoadResult:
        """See Engine.load (`keys` are distinct: the engine checked)."""
        layout = buffers.layout
        with trace.span("check rows"):
            dst = row_ids(rows, layout.page_rows, "kv row", unique=True)
            dst_slot = np.empty(0, np.int64)
            if layout.needs_checkpoint:
                if slot is None:
                    raise InvalidArgument("this layout has slot buffers: give the state slot to load into")
                dst_slot = row_ids([slot], layout.slot_rows, "state slot")
        limit = len(dst) if layout.needs_pages else len(keys)
        readable = self.mover.readable(transfer)
        damaged = 0
        for _ in range(_ATTEMPTS):
            with trace.span("match"):
                hit = self.books.match(layout, keys[:limit], None if checks is None else checks[:limit],
                                       pin=True, readable=readable)
            if hit.match.pages == 0:
                self.reap()
                return LoadResult(hit.match, {}, damaged)
            with trace.span("order"):  # the copies wait for the worker's ready mark
                transfer.wait_for(ready, "load")
            jobs: list[Job] = []  # a layout without paged buffers loads its checkpoint only
            if layout.needs_pages:
                group = Group.pages(buffers, transfer)
                jobs += [(group, hit.page_rows[part], dst[part]) for part in _split(hit.match, group.nbytes)]
            if hit.checkpoint_row is not None:
                jobs.append((Group.checkpoints(buffers, transfer), np.array([hit.checkpoint_row]),
                             dst_slot))
            done = self.deliver(hit.rows, jobs, transfer, asynchronous, done_event, alive)
            with trace.span("reap"):  # the last loads' pins, after this one's copies are
                self.reap(spare=done.own)  # queued: not in their way
            damaged += len(done.damaged)
            if not done.damaged:
                self.books.count("loads", 1)
                self.books.count("loaded_pages", hit.match.pages)
                return LoadResult(hit.match, done.bytes_from, damaged, done.event)
        return LoadResult(Match(0, 0, len(keys), b"", None, StopReason.MISSING_PAGE), {}, damaged)

    def deliver(self, pinned: np.ndarray, jobs: list[Job], transfer: Transfer,
                asynchronous: bool = False, done_event: Any = None,
                alive: Callable[[], bool] | None = None) -> Delivery:
        """Bring pinned entries into host memory (promoting disk hits) and, where a job
        names destination rows, scatter them into the worker, unless its caller stopped
        waiting meanwhile (`alive`): told the load failed, the worker may be writing those
        rows itself. `pinned` is unpinned when the copies are done: now, or, for an
        asynchronous load, once its event completes."""
        done, complete, copying = Delivery(), False, 0.0
        try:
            self.promotions.await_moves(pinned)
            for group, entry_rows, dst in jobs:
                staged = self._stage(group, entry_rows, dst is not None, done)
                if staged is None or dst is None:
                    continue
                failpoints.hit("load.before_scatter")
                if alive is not None and not alive():
                    raise DeadlineExceeded("the call ended before the load wrote the worker's "
                                           "rows: the rest of it was dropped")
                copying += self._scatter(transfer, group, staged, dst, done)
            self._fence(transfer, done, asynchronous, copying, done_event)
            failpoints.hit("load.before_reply")
            complete = True
        except BaseException:
            transfer.synchronize()  # nothing may still read entries we are about to unpin
            raise
        finally:
            with trace.span("settle"):
                self._settle(done, pinned, asynchronous, complete)
        if not asynchronous:
            done.event = None
        return done

    def _stage(self, group: Group, entry_rows: np.ndarray, staging_ok: bool,
               done: Delivery) -> tuple[list[SlabPart], dict[Tier, int]] | None:
        """Host (or device) memory holding the pinned `entry_rows`; disk entries are read
        into the load's promoted slots or, where `staging_ok`, a staging buffer (page-locked
        for a GPU). Returns (parts, entries per tier they come from), or None when a disk
        entry turned out damaged."""
        nbytes = group.nbytes
        with trace.span("locate"):
            found = self.promotions.locate(entry_rows, nbytes,
                                           group.transfer is self.mover.device_transfer)
        if found.move is not None:
            done.moves.append((found, nbytes))
        promo, from_disk = found.promo, found.from_disk
        if not staging_ok:
            from_disk = from_disk[:len(promo)]
        pool = self.books.host.pool(nbytes)
        slots = found.host_slots.copy()
        # disk entries without a promoted slot are read into staging memory (page-locked for
        # a GPU); most loads need none (an empty tensor for each took ~50 us on an H100 host)
        staging = None
        if len(from_disk) > len(promo):
            staging = torch.empty((len(from_disk) - len(promo), nbytes), dtype=torch.uint8,
                                  pin_memory=group.transfer.device.type == "cuda")
            done.staging.append(staging)
        if len(from_disk):
            bad = self.mover.read(group.kind, entry_rows[from_disk], self.books.keys(entry_rows[from_disk]),
                                  [pool.view(s) for s in promo] + list(() if staging is None else staging))
            if bad:
                done.damaged.extend(bad)
                return None
            slots[from_disk[:len(promo)]] = promo
        here = slots >= 0
        parts = _parts(pool, slots[here], here)
        if len(found.device_slots):
            parts += _parts(self.books.device.pool(nbytes), found.device_slots, found.on_device)
        if staging is not None:
            parts.append(SlabPart(staging, np.arange(len(staging)), from_disk[len(promo):]))
        counts = {Tier.DEVICE: len(found.device_slots), Tier.DISK: len(from_disk),
                  Tier.HOST: len(entry_rows) - len(found.device_slots) - len(from_disk)}
        return parts, counts

    def _scatter(self, transfer: Transfer, group: Group,
                 staged: tuple[list[SlabPart], dict[Tier, int]], dst: np.ndarray,
                 done: Delivery) -> float:
        """Copy staged entries into the worker's rows, counting the bytes by the tier they
        came from; returns the seconds the call took."""
        parts, counts = staged
        start = time.perf_counter()
        with trace.span("copy" if group.kind == Kind.PAGE else "copy checkpoint"):
            transfer.scatter(parts, group.buffers, group.offsets, dst)
        for tier, count in counts.items():
            if count:
                done.bytes_from[tier] = done.bytes_from.get(tier, 0) + count * group.nbytes
        return time.perf_counter() - start

    def _fence(self, transfer: Transfer, done: Delivery, asynchronous: bool, copying: float,
               into: Any = None) -> None:
        """End a delivery's copies: wait for them, or hand back the event that marks them
        done, and count the bytes by hop: device entries reach the worker from the device,
        the rest from host memory (a host slot, or staging for a disk entry)."""
        start = time.perf_counter()
        with trace.span("fence"):
            done.event = transfer.fence("load", interprocess=asynchronous, into=into)
            if asynchronous:  # the worker holds the event it is handed and may record it
                # itself: whether the copies are done is asked of an event of our own
                done.own = transfer.fence("load")
            else:
                done.event.synchronize()
        seconds = None if asynchronous else copying + time.perf_counter() - start
        from_device = done.bytes_from.get(Tier.DEVICE, 0)
        from_host = sum(done.bytes_from.values()) - from_device
        # one copy read both: its time belongs to neither hop alone, so it is not timed
        if from_device and from_host:
            seconds = None
        for source, nbytes in (("device", from_device), ("host", from_host)):
            if nbytes:
                self.traffic.record(source, "worker", nbytes, seconds)

    def _settle(self, done: Delivery, pinned: np.ndarray, asynchronous: bool, complete: bool) -> None:
        """After a delivery: publish the load's promotions (none if an entry was damaged or
        the delivery failed part way: their slots may hold part of their bytes) while its
        pins still hold their rows (unpinned, a row may be evicted and handed to another
        key before its promoted slot is published onto it); then unpin, or leave pinned
        for the copies still running; drop the damaged."""
        ok = complete and not done.damaged
        try:
            for found, nbytes in done.moves:
                placed = Placed(found.move.rows, found.promo, nbytes, bad=[])
                done.promoted += self.promotions.finish(found.move, [placed], complete=ok)
        finally:
            if done.event is not None and asynchronous and ok:
                with self._lock:
                    self._pending.append((done.own, pinned, done.staging))
                    self._handed_out.append(done.event)
            else:
                self.books.unpin(pinned)
        if done.damaged:
            self.mover.settle(self.books.drop(np.asarray(done.damaged, np.int64)))

