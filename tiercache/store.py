"""The store path: a prompt's KV pages and the checkpoints admission keeps, copied out of
the worker's rows into the first tier.

A store claims the keys nobody holds or writes (the books), reserves slots (settling
what an eviction displaced, outside the lock), copies the rows in batches and publishes
each batch once its bytes are all there (invariant 1). The first parts of its pages into
host memory are copied before their claim, where nobody seems to hold them: a copy the
claim finds was not needed only frees its slot once done. Device-tier workers store device
to device and the background copies the entries down to the host; a durable store then
waits until every entry is committed to disk.

A GPU worker's store may hand over an event of its own (`StoreJob.done`): the store then
returns once its copies are queued, recording the event after them (the worker's stream
waits on it before it writes the rows again), and its entries are published when the
copies are done, by a thread of their own (`Publishing`). Every call into the engine
first waits until the stores that returned before it began are published, so a call
made after a store's reply sees its entries, as if the store had waited.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from tiercache import failpoints, trace
from tiercache.admission import admit, entry_values
from tiercache.background import Background, Mover, Runner
from tiercache.books import Books, Claim
from tiercache.buffers import WorkerBuffers, row_ids
from tiercache.errors import (DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted,
                             Unavailable)
from tiercache.hashing import Keys, distinct_keys
from tiercache.load import SPLIT_BYTES, Group, growing_parts
from tiercache.metrics import Traffic
from tiercache.policy import AdmissionConfig
from tiercache.results import Kind, StoreResult, Tier
from tiercache.room import Displaced
from tiercache.transfer import Transfer

Alive = Callable[[], bool]
log = logging.getLogger("tiercache.store")


@dataclass(frozen=True)
class StoreJob:
    """One store, as the engine's store calls describe it."""

    buffers: WorkerBuffers
    chain: np.ndarray  # the prompt's page keys
    src: np.ndarray | None  # the worker's row of each page (None: checkpoints only)
    slots: dict[int, int]  # the checkpoints to keep: pages -> the worker's state slot
    transfer: Transfer
    ready: Any = None  # an event the worker recorded after writing the rows (GPU)
    checks: np.ndarray | None = None  # one per key (hashing.page_chain)
    alive: Alive | None = None  # whether the caller still waits (its rows are still ours)
    pins: list[np.ndarray] | None = None  # a durable store pins what it publishes or finds
    first: int = 0  # the chain is pages first+1.. of the prompt
    shared: bool = False  # its new entries may go to the remote tier when they leave
    done: Any = None  # the worker's event to record after the copies: return once queued
    scope: Hashable = None  # whose later calls see its entries, once it replied (Publishing)

    def again(self, depths: np.ndarray) -> "StoreJob":
        """This store once more, for the checkpoints at `depths` only (pages all again),
        waited for (a durable store's)."""
        return StoreJob(self.buffers, self.chain, self.src, {d: self.slots[d] for d in depths.tolist()},
                        self.transfer, None, self.checks, self.alive, self.pins, self.first,
                        self.shared)


def checks_of(checks: np.ndarray | None, keys: np.ndarray) -> np.ndarray | None:
    """Checks as uint64, one per key, or None."""
    if checks is None:
        return None
    checks = np.asarray(checks, np.uint64).reshape(-1)
    if len(checks) != len(keys):
        raise InvalidArgument(f"got {len(checks)} checks for {len(keys)} keys: give one per key")
    return checks


class Stores:
    def __init__(self, books: Books, mover: Mover, background: Background, traffic: Traffic,
                 admission: AdmissionConfig) -> None:
        self.books = books
        self.mover = mover
        self.background = background
        self.traffic = traffic
        self.admission = admission
        self.publishing = Publishing(books)

    def job(self, buffers: WorkerBuffers, keys: Keys, rows: Sequence[int],
            checkpoints: Mapping[int, int] | None, transfer: Transfer, ready: Any,
            checks: np.ndarray | None, alive: Alive | None, durable: bool,
            first: int = 0, shared: bool = False, done: Any = None,
            scope: Hashable = None) -> StoreJob:
        """Check a store's input and keep the checkpoints admission picks of those offered.
        With `first`, the keys are pages first+1.. and checkpoints still count from page 1.
        `done` is ignored for a durable store, which returns once on disk anyway."""
        layout, chain = buffers.layout, distinct_keys(keys)
        checks = checks_of(checks, chain)
        offered = dict(checkpoints or {})
        if first < 0 or (first and not len(chain)):
            raise InvalidArgument(f"first_page {first} needs the keys of the pages after it")
        bad = [n for n in offered if not first < n <= first + len(chain)]
        if bad:
            raise InvalidArgument(f"checkpoint at page {bad[0]} is outside the pages sent, "
                                  f"{first + 1} to {first + len(chain)}")
        if offered and not layout.needs_checkpoint:
            raise InvalidArgument("this layout has no slot buffers: offer no checkpoints")
        slots = dict(zip(offered, row_ids(list(offered.values()), layout.slot_rows,
                                          "state slot").tolist()))
        src = page_rows(buffers, chain, rows) if layout.needs_pages else None
        if src is None and len(rows):
            raise InvalidArgument("this layout has no paged buffers: give no kv rows")
        # how much is cached weighs on which checkpoints to keep: without offers, no lookup
        kept = np.empty(0, np.int64)
        if offered:
            cached = first + self.books.cached_pages(chain) if layout.needs_pages else 0
            kept = admit(self.admission, offered, first + len(chain), cached)
            self.books.count("declined_checkpoints", len(offered) - len(kept))
        if durable and self.books.disk is None:  # before any copying
            raise FailedPrecondition("durable stores need a disk tier: start the daemon with one")
        return StoreJob(buffers, chain, src, {n: slots[n] for n in kept.tolist()}, transfer, ready,
                        checks, alive, [] if durable else None, first, shared,
                        None if durable else done, scope)

    def store(self, job: StoreJob, timeout: float | None = None) -> StoreResult:
        try:
            result = self.chain(job)
            if job.pins is not None:
                self.persist(job, result, timeout)
            return result
        finally:
            if job.pins:
                self.books.unpin(np.concatenate(job.pins))

    def chain(self, job: StoreJob) -> StoreResult:
        """Store the pages of a chain (if any) and its kept checkpoints, all under one
        stamp, each entry rated by what it saves (admission.entry_values). The
        checkpoint's copy is launched before the pages' copies are waited for: on the
        device tier both copies take less time than claiming either. The first parts of
        the pages into host memory are copying before the stamp, the values and their
        claim (`_Flight.ahead`)."""
        layout, depths = job.buffers.layout, np.array(sorted(job.slots), np.int64)
        first, local = job.first, np.array(sorted(job.slots), np.int64) - job.first - 1
        published: dict[Tier, list[np.ndarray]] = {}
        flights: list[_Flight] = []
        pages = checkpoints = None
        try:
            if job.src is not None:
                pages = self._flight(job, Group.pages(job.buffers, job.transfer), published)
                flights.append(pages)
                pages.ahead(job.chain, job.src)
            stamp, found = self.books.stamp(job.chain, layout.needs_checkpoint)
            # worth counts from the checkpoints on the chain sent: a store that adds to a hit
            # starts at the hit's last page (Worker.store), whose checkpoint is found here
            ends = np.union1d(np.flatnonzero(found >= 0) + 1 + first, depths)
            page_values, end_values = entry_values(layout, first + len(job.chain), ends)
            page_values = page_values[first:]
            if pages is not None:
                self._claim(pages, job.chain, np.arange(first + 1, first + len(job.chain) + 1),
                            job.src, page_values, stamp, job.checks)
                if pages.found_no_room():  # the checkpoint would stand on no pages
                    pages.result(len(job.chain))  # raises
            elif layout.needs_pages and len(depths):  # the pages under a new checkpoint are worth more
                self.books.raise_values(Kind.PAGE, job.chain, page_values)
            if len(depths):
                checkpoints = self._flight(job, Group.checkpoints(job.buffers, job.transfer), published)
                flights.append(checkpoints)
                self._claim(checkpoints, job.chain[local], depths,
                            np.array([job.slots[d] for d in depths.tolist()], np.int64),
                            end_values[np.searchsorted(ends, depths)], stamp,
                            None if job.checks is None else job.checks[local])
        except BaseException:
            self._complete(flights, published, finish=False)
            raise
        if job.done is None:
            self._complete(flights, published)
        else:  # the worker's stream waits on `done`; the entries are published once copied
            job.transfer.fence("store", into=job.done)
            for flight in flights:
                flight.replied = True
            self.publishing.add(lambda: self._complete(flights, published), job.scope)
        result = StoreResult(0, 0, 0)
        if pages is not None:
            result += pages.result(len(job.chain))[0]
        if checkpoints is not None:
            part, kept = checkpoints.result(len(depths))
            result += StoreResult(part.stored, part.present, part.skipped, tuple(depths[kept].tolist()))
        return result

    def _complete(self, flights: list["_Flight"], published: dict[Tier, list[np.ndarray]],
                  finish: bool = True) -> None:
        """Publish what the flights copied (unless not to `finish`), close them (each,
        whatever another's close raised), then start the copies down and to disk: launched
        between a store's copies, they would take the GPU's SMs and the GIL from them."""
        try:
            with ExitStack() as closing:
                for flight in flights:
                    closing.callback(flight.close)
                for flight in flights if finish else ():
                    flight.finish()
        finally:
            for tier, rows in published.items():
                (self.background.stored_on_device if tier == Tier.DEVICE else self.background.stored)(
                    np.concatenate(rows))

    def _flight(self, job: StoreJob, group: Group, published: dict[Tier, list[np.ndarray]]
                ) -> "_Flight":
        """A flight of `group`'s copies into the first tier: the device tier for workers on
        its GPU, else the host; its copies wait for the worker's ready mark. The caller
        claims its entries (`_claim`), finishes it (publishes what is still copying) and
        closes it."""
        group.transfer.wait_for(job.ready, "store")
        device = group.transfer is self.mover.device_transfer
        return _Flight(self, job, group, Tier.DEVICE if device else Tier.HOST, published)

    def _claim(self, flight: "_Flight", keys: np.ndarray, depths: np.ndarray, src: np.ndarray,
               values: np.ndarray, stamp: int, checks: np.ndarray | None) -> None:
        """Claim a flight's entries and launch their copies.

        On the host tier, a pipeline: the keys are claimed in parts (the first small, so
        the first copy starts early, or copied before it is claimed: `_Flight.ahead`),
        each part's batches are launched as soon as their slots are reserved, and a batch
        is published once its copy is done, while the next one runs: the bookkeeping of
        one part overlaps the copy of the one before.
        The device tier takes all keys as one part: its copy device to device is shorter
        than claiming, so more parts would only add claims, launches and publishes."""
        job, group = flight.job, flight.group
        flight.stamp = stamp
        parts = ([slice(0, len(keys))] if flight.tier == Tier.DEVICE
                 else _parts(len(keys), group.nbytes, ahead=flight.early is not None))
        for part in parts:
            with trace.span("claim"):
                claim = self.books.claim(group.kind, keys[part], depths[part], group.nbytes,
                                         values[part], stamp,
                                         None if checks is None else checks[part], job.shared,
                                         job.pins)
            flight.copy(part, claim, src[part])

    def persist(self, job: StoreJob, stored: StoreResult, timeout: float | None) -> None:
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
            self.books.check_open()
            rows = np.concatenate([self.books.rows_of(Kind.PAGE, job.chain) if job.src is not None else [],
                                   self.books.rows_of(Kind.CHECKPOINT,
                                                      job.chain[depths - job.first - 1])]
                                  ).astype(np.int64)
            if np.all(np.isin(rows, np.concatenate(job.pins) if job.pins else [])):
                break
            if time.monotonic() > deadline:
                raise DeadlineExceeded("entries of a durable store stayed in other stores' hands "
                                       "until the deadline: its entries may or may not be durable")
            time.sleep(0.001)  # others may still be writing them: store again what is missing
            self.chain(job.again(depths))
        todo = rows[~self.books.in_tier(rows, Tier.DISK)]
        if self.books.device is not None:  # device-only entries go down first
            down = self.books.begin_copy_down(todo)
            if down is not None:
                copied = Mover._try(lambda: self.mover.copy_down(down) or True, "a copy down")
                self.books.end_copy_down(down, copied)
        left = None if timeout is None else deadline - time.monotonic()
        if not self.background.write_and_wait(todo, left):
            raise DeadlineExceeded("the deadline passed before the store reached disk: "
                                   "its entries may or may not be durable")
        if not np.all(self.books.in_tier(rows, Tier.DISK)):
            raise ResourceExhausted("the disk tier could not take the store's entries: "
                                    "raise --disk-map-size or store without durable")


_FIRST_PART = 512  # keys claimed before the first copy starts; each part after is 2x larger


def _parts(count: int, entry_bytes: int, ahead: bool = False) -> list[slice]:
    """The parts a store's keys are claimed in: 512, 1,024, 2,048, ... keys (claiming
    twice the keys takes the CPU less time than the GPU takes to copy a part's rows
    into host memory, so the copies follow one another); a store of SPLIT_BYTES or more
    starts with an eighth of its keys, if fewer (pages of 1 MiB rows are many MiB each).
    A first part copied `ahead` of its claim takes the first two: its claim, the stamp
    and the values come while it copies (with the first alone, the second part's copy
    came too late for them: 4 KiB rows, H200, RESULTS.md, the thirtieth round)."""
    large = count * entry_bytes >= SPLIT_BYTES
    parts = growing_parts(count, min(_FIRST_PART, count // 8) if large else _FIRST_PART)
    return [slice(0, parts[1].stop), *parts[2:]] if ahead and len(parts) > 1 else parts


@dataclass
class _Part:
    """One part's claim and how many of its entries (a prefix of claim.todo) are
    launched and published."""

    where: slice
    claim: Claim
    launched: int = 0
    published: int = 0


@dataclass
class _Batch:
    part: _Part | None  # None while copied ahead of its part's claim
    slots: list[int]  # of the part's entries, in claim.todo's order
    tier: Tier
    done: Any  # the event that marks its copy done
    started: float
    spare: list[int] = field(default_factory=list)  # copied ahead for no entry: freed once done


class _Flight:
    """The batches of one store's copies: launched in order on one stream, published
    in order, each once its copy is done (invariant 1) and the caller still waits or
    the store replied with its copies queued (`replied`: the worker's stream waits for
    them before it writes the rows again)."""

    def __init__(self, stores: Stores, job: StoreJob, group: Group, tier: Tier,
                 published: dict[Tier, list[np.ndarray]]) -> None:
        self.stores, self.books, self.job, self.group = stores, stores.books, job, group
        self.stamp, self.tier = 0, tier  # the stamp: the store's, set before its claims
        self.parts: list[_Part] = []
        self.flying: list[_Batch] = []
        self.early: _Batch | None = None  # the first part's copy, launched ahead of its claim
        self.full = False  # no room was found: the parts after are claimed and let go
        self.published = published  # rows by tier, for the background once the store is done
        self.last_done = 0.0
        self.replied = False

    def ahead(self, keys: np.ndarray, src: np.ndarray) -> None:
        """Launch the copy of the first part's entries (of `keys`, from rows `src`; the
        first two parts of `_parts`) before they are claimed, where that most likely
        costs no work: into host memory, if nobody holds the part's first and last keys.
        A GPU's copy then runs while the stamp, the values and the claim are done
        (without it, the GPU waited 0.3-0.4 ms for them on an H200 host: RESULTS.md, the
        thirtieth round of issue 15). Entries the claim finds cached, or another
        store's, were copied for nothing: their slots are freed once the copy is done
        (`finish`). Without room for the whole part at once, nothing goes ahead."""
        group = self.group
        if self.tier != Tier.HOST or not len(keys):
            return
        where = _parts(len(keys), group.nbytes, ahead=True)[0]
        if self.books.holds_any(group.kind, keys[[where.start, where.stop - 1]]):
            return
        count = where.stop - where.start
        slots, displaced = self.books.reserve(group.nbytes, count, self.tier)
        if displaced:
            self._settle(displaced, slots)
        if len(slots) < count:
            self.books.free(group.nbytes, slots, self.tier)
            return
        self._launch(None, src[where], slots)
        self.early = self.flying[-1]

    def copy(self, where: slice, claim: Claim, src: np.ndarray) -> None:
        """Launch the copies of a part's claimed entries, as far as room is found;
        publish the batches launched before, which the GPU has done by then, mostly."""
        part = _Part(where, claim)
        self.parts.append(part)
        early, self.early = self.early, None
        if early is not None:  # the part's entries, all copying since before the claim
            assert len(early.slots) == where.stop - where.start, "the part copied ahead is the first"
            kept = np.zeros(len(early.slots), bool)
            kept[claim.todo] = True
            slots = np.asarray(early.slots, np.int64)
            early.part, early.slots, early.spare = part, slots[kept].tolist(), slots[~kept].tolist()
            part.launched = len(claim.todo)
        todo, group = claim.todo, self.group
        while not self.full and part.launched < len(todo):
            with trace.span("reserve"):
                slots, displaced = self.books.reserve(group.nbytes, len(todo) - part.launched, self.tier)
            # room that an eviction must move first: move it, and ask again while that frees some
            if displaced and self._settle(displaced, slots) and not slots:
                continue
            if not slots and self.flying:  # the room is this store's own copies in flight:
                self.finish()  # published, they may make room for the rest
                continue
            if not slots and self.tier == Tier.DEVICE:  # too small, pinned by loads, or its
                self.tier = Tier.HOST  # victims found no room below: the host takes the rest
                continue
            if not slots:
                self.full = True
                break
            batch = todo[part.launched:part.launched + len(slots)]  # shallow pages first
            self._launch(part, src[batch], slots)
            self.finish(keep=1)  # the batch just launched runs while the next part is claimed

    def _settle(self, displaced: Displaced, slots: list[int]) -> int:
        """Move what the eviction that made room displaced; the slots just reserved go
        back if that fails (nothing else would free them)."""
        try:
            return self.stores.mover.settle(displaced)
        except BaseException:
            self.books.free(self.group.nbytes, slots, self.tier)
            raise

    def _launch(self, part: _Part | None, src: np.ndarray, slots: list[int]) -> None:
        group, arena = self.group, self.books.arena(self.tier)
        started = time.perf_counter()
        try:
            failpoints.hit("store.before_gather")
            with trace.span("copy"):
                group.transfer.gather(group.buffers, group.offsets, src,
                                      list(arena.pool(group.nbytes).parts(np.asarray(slots, np.int64))))
                done = group.transfer.fence("store")  # this batch only, not the device
        except BaseException:
            group.transfer.synchronize()  # nothing may still write the slots it frees
            self.books.free(group.nbytes, slots, self.tier)
            raise
        self.flying.append(_Batch(part, slots, self.tier, done, started))
        if part is not None:
            part.launched += len(slots)

    def finish(self, keep: int = 0) -> None:
        """Publish the batches launched first, all but the last `keep`, as their copies
        complete. Nothing is published once the caller stopped waiting before a reply:
        its rows may hold other bytes by then."""
        job, group = self.job, self.group
        while len(self.flying) > keep:
            batch, part = self.flying[0], self.flying[0].part
            assert part is not None, "a batch copied ahead is finished after its part's claim"
            with trace.span("fence"):
                batch.done.synchronize()
            now = time.perf_counter()
            self.stores.traffic.record("worker", batch.tier.name.lower(),
                                       (len(batch.slots) + len(batch.spare)) * group.nbytes,
                                       now - max(batch.started, self.last_done))
            self.last_done = now
            if batch.spare:  # copied, and nobody's: the slots are free again
                self.books.free(group.nbytes, batch.spare, batch.tier)
                batch.spare = []
            failpoints.hit("store.before_publish")
            if job.alive is not None and not self.replied and not job.alive():
                raise DeadlineExceeded("the call ended while its rows were being copied: "
                                       "the rest of the store was dropped")
            if getattr(job.ready, "forced", False):  # tiercache/signals.py
                raise Unavailable("the worker went before it had written the store's rows: "
                                  "the daemon's copies were released, and the store dropped")
            with trace.span("publish"):
                rows = part.claim.rows[part.published:part.published + len(batch.slots)]
                if len(rows):
                    self.books.publish_claimed(rows, batch.tier, batch.slots, self.stamp,
                                               pin=job.pins is not None)
                    if job.pins is not None:
                        job.pins.append(rows)
                    self.published.setdefault(batch.tier, []).append(rows)
            part.published += len(batch.slots)
            self.flying.pop(0)

    def found_no_room(self) -> bool:
        """Whether the flight launched nothing of what it had to copy, for want of room."""
        return self.full and not any(part.launched for part in self.parts)

    def close(self) -> None:
        """Free what was launched but not published (after its copy: nothing may still
        write a freed slot) and let go of every claimed row not published."""
        try:
            if self.flying:
                self.group.transfer.synchronize()
            for batch in self.flying:
                self.books.free(self.group.nbytes, batch.slots + batch.spare, batch.tier)
            self.flying, self.early = [], None
        finally:
            for part in self.parts:
                todo = len(part.claim.todo)
                self.books.unclaim(self.group.kind, part.claim, part.published, todo - part.published)

    def result(self, count: int) -> tuple[StoreResult, np.ndarray]:
        """The store's result and which of its `count` keys are cached once what it
        launched is published (finished, or replied)."""
        kept = np.ones(count, bool)
        stored = present = skipped = todo = 0
        for part in self.parts:
            claim, first = part.claim, part.where.start
            kept[first + claim.todo[part.launched:]] = False
            kept[first + claim.clashes] = False
            stored += part.launched
            todo += len(claim.todo)
            present += part.where.stop - first - len(claim.todo) - len(claim.clashes)
            skipped += len(claim.todo) - part.launched + len(claim.clashes)
        if todo and not stored:
            tier, arena = self.tier, self.books.arena(self.tier)
            raise ResourceExhausted(
                f"no room in the {tier.name.lower()} tier for a {self.group.nbytes}-byte entry (budget "
                f"{arena.budget_bytes} bytes, the rest pinned by loads): raise the "
                f"{tier.name.lower()} budget")
        return StoreResult(stored, present, skipped), kept


def page_rows(buffers: WorkerBuffers, chain: np.ndarray, rows: Sequence[int]) -> np.ndarray:
    src = row_ids(rows, buffers.layout.page_rows, "kv row")
    if len(src) != len(chain):
        raise InvalidArgument(f"got {len(chain)} page keys but {len(src)} kv rows: give one row per page")
    return src


ALL_SCOPES, NO_SCOPE = object(), object()  # Publishing.settle: every scope's stores, or none


class Publishing:
    """Stores that replied with their copies queued, by scope (the daemon's is the
    caller's tenant: no call of one tenant can see another's entries). Each scope's
    stores are completed (their entries published, `Stores._complete`) in the order they
    replied, by a thread of the scope's own as soon as their copies are done, or by a
    call of the scope that begins after the reply (`settle`). So a store whose copies
    still wait for its worker's GPU work holds back the calls of its own scope only."""

    def __init__(self, books: Books) -> None:
        self.books = books
        self._queues: dict[Hashable, _Queue] = {}
        self._lock = threading.Lock()

    def add(self, complete: Callable[[], None], scope: Hashable = None) -> None:
        with self._lock:
            queue = self._queues.get(scope)
            if queue is None:
                queue = self._queues[scope] = _Queue(self.books)
        queue.add(complete)

    def settle(self, scope: Hashable = ALL_SCOPES) -> None:
        """Return once every store of `scope` that replied before this call is completed."""
        with self._lock:
            queues = list(self._queues.values()) if scope is ALL_SCOPES else [self._queues.get(scope)]
        for queue in queues:
            if queue is not None:
                queue.settle()

    def close(self) -> None:
        with self._lock:
            queues = list(self._queues.values())
        for queue in queues:
            queue.close()


class _Queue:
    """One scope's stores that replied, completed in order, once each."""

    def __init__(self, books: Books) -> None:
        self.books = books
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        self._added = self._completed = 0
        self._lock = threading.Lock()  # the queue and its counts
        self._turn = threading.Lock()  # held while one is completed: in order, once each
        self._runner = Runner(self._step, "tiercache-publish")

    def add(self, complete: Callable[[], None]) -> None:
        with self._lock:
            self._queue.append(complete)
            self._added += 1
        self._runner.start()
        self._runner.kick()

    def settle(self) -> None:
        upto = self._added
        while self._completed < upto and self._step():
            pass

    def close(self) -> None:
        self.settle()
        self._runner.stop()

    def _step(self) -> bool:
        with self._turn:
            with self._lock:
                if not self._queue:
                    return False
                complete = self._queue[0]
            try:
                complete()
            except Exception as error:  # its entries stay unpublished: a miss, not a wrong hit
                self.books.count("unpublished_stores", 1)
                log.error("a store that had replied could not publish its entries (they were "
                          "dropped): %s: %s", type(error).__name__, error)
            finally:
                with self._lock:
                    self._queue.popleft()
                    self._completed += 1
        return True
