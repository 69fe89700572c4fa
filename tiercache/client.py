"""The worker's side of tiercache: one API over a daemon or over an engine in-process.

    client = Client("unix:./tiercache-data/tiercache.sock")   # or EmbeddedClient()
    worker = client.register("my-model", layout)               # buffers in shared memory
    hit = worker.match(tokens)                                  # hashed here, keys only on the wire
    worker.load(tokens, kv_rows=rows[:hit.pages], slot=3)       # bytes land in worker.paged / .slots
    worker.store(tokens, kv_rows=rows, checkpoints={len(tokens) // 16 * 16: 3})

Checkpoints are offered by token position (a multiple of the page size): the state
after that many tokens, in the given state slot. Calls given tokens also send each page's
check (hashing.page_chain), so a key collision is a miss; calls given keys send none.
`store(..., durable=True)` returns only once the prompt is committed to disk.

Over TCP, pass `tls=Tls(...)` (and a client certificate for mTLS); where the daemon maps
tokens to tenants, pass `token=`: it goes with every call as `authorization: Bearer`.

GPU workers pass their own CUDA tensors to `register(..., buffers=...)`; the daemon maps
them by CUDA IPC. CPU workers may do the same with views into a `shared_region` of theirs.
The ranks of a tensor-parallel group register with `group=GroupMember(...)` and match as
one (tiercache.group). Their copies are ordered with the worker's current CUDA stream in both
directions, without host synchronisation: the daemon starts after a mark queued on
that stream (tiercache.signals), and a load returns at once with the stream already
waiting on the mark of the bytes in place; so does a store through a daemon, with the stream waiting
until the rows are copied out (pass `synchronous=True` to either to wait on the host
instead). A call made after a store returns sees its entries either way. A GPU worker
with an outbox (`register(..., outbox_pages=N)`) may `post` a store instead: its rows are
free once copied into the outbox on the stream, and the call goes from a thread
(tiercache/outbox.py). `post_load` is `load` whose reply a thread waits for: the stream
reads the rows once they are in place, before the worker knows whether the load did
what it asked (check the future's result before using what that work produced).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Protocol, Sequence, TypeVar

import grpc
import numpy as np
import torch

from tiercache.buffers import WorkerBuffers, device_buffers, int_ids
from tiercache.call_stream import CallStream
from tiercache.lane import Lane
from tiercache.channel import DEFAULT_ADDRESS, Tls, connect  # noqa: F401 (the API names both here too)
from tiercache.cuda_ipc import OpenedEvents  # cuda-bindings only once a buffer is exported
from tiercache.errors import InvalidArgument, TiercacheError, Unavailable
from tiercache.group import Group, GroupMember
from tiercache.hashing import (Chain, Keys, Namespace, PageKey, check_prompt, key_array, page_chain,
                               page_keys, token_array)
from tiercache.results import CacheStats, LoadResult, Match, StoreResult, Tier
from tiercache.layout import Layout
from tiercache.outbox import Outbox, outbox_layout
from tiercache.regions import SharedRegion, region_locations
from tiercache.shm import SharedBuffers
from tiercache.signals import Call, WorkerSignals, process_started
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc
from tiercache.wire import (answered, layout_to_proto, load_from_proto, match_from_proto,
                            store_from_proto, tier_stats_from_proto)

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the engine (LMDB, the movers) loads only for the embedded client
    from tiercache.engine import Engine, EngineConfig

T = TypeVar("T")


@dataclass(frozen=True)
class Request:
    """A prompt as it goes on the wire: keys and (when hashed from tokens) checks, packed."""

    keys: bytes
    checks: bytes = b""
    tokens: bytes = b""  # stores that publish their tokens in KV events only
    first_page: int = 0  # stores: the keys are pages first_page+1.. of the prompt


class Backend(Protocol):
    """What a Worker needs from the cache."""

    def match(self, prompt: Request, prefetch: bool) -> Match: ...
    def load(self, prompt: Request, rows: np.ndarray, slot: int | None, synchronous: bool) -> LoadResult: ...
    def post_load(self, prompt: Request, rows: np.ndarray, slot: int | None) -> Future[LoadResult]: ...
    def store(self, prompt: Request, rows: np.ndarray, checkpoints: Mapping[int, int],
              durable: bool, ready: Any = None, synchronous: bool = False) -> StoreResult: ...
    def evict(self, prompt: Request, tier: Tier | None) -> int: ...
    def connected(self) -> bool: ...
    def close(self) -> None: ...


class Worker:
    """A registered worker: its buffers (`paged`, `slots`), and prompts hashed locally."""

    def __init__(self, backend: Backend, layout: Layout, root: PageKey, hash_name: str,
                 tensors: Mapping[str, torch.Tensor]) -> None:
        self.layout = layout
        self.root = root
        self.hash_name = hash_name
        self.paged = {b.name: tensors[b.name] for b in layout.paged}
        self.slots = {b.name: tensors[b.name] for b in layout.slots}
        self._backend = backend
        self._outbox: Outbox | None = None  # Client.register(..., outbox_pages=N)

    def keys(self, tokens: Any) -> list[PageKey]:
        """The page keys of a prompt in this worker's namespace (full pages only)."""
        return page_keys(tokens, self.root, self.layout.page_tokens, self.hash_name)

    def _packed(self, tokens: Any, keys: Keys | Chain | None) -> Request:
        check_prompt(tokens, keys)
        if isinstance(keys, Chain):  # keys hashed elsewhere, with their checks
            return Request(key_array(keys.keys).tobytes(), keys.checks.astype("<u8").tobytes())
        if keys is not None:
            return Request(key_array(keys).tobytes())
        chain = page_chain(tokens, self.root, self.layout.page_tokens, self.hash_name)
        return Request(key_array(chain.keys).tobytes(), chain.checks.astype("<u8").tobytes())

    def match(self, tokens: Any = None, *, keys: Keys | Chain | None = None,
              prefetch: bool = False) -> Match:
        return self._backend.match(self._packed(tokens, keys), prefetch)

    def load(self, tokens: Any = None, *, keys: Keys | Chain | None = None, kv_rows: Sequence[int] = (),
             slot: int | None = None, synchronous: bool = False) -> LoadResult:
        """Copy the longest hybrid match (at most len(kv_rows) pages) into kv_rows and slot.
        On a GPU the current stream is made to wait for the copies (see the module doc),
        whatever the load returns or raises: through a daemon, a load that failed may have
        queued copies into the rows before it did."""
        return self._backend.load(self._packed(tokens, keys), _row_array(kv_rows), slot, synchronous)

    def post_load(self, tokens: Any = None, *, keys: Keys | Chain | None = None,
                  kv_rows: Sequence[int] = (), slot: int | None = None) -> Future[LoadResult]:
        """`load`, without waiting for the daemon's reply: the current stream is made to
        wait for the copies now, the call is sent, and a thread of the worker's waits for
        its reply. Work queued on the stream after this runs once the copies are done,
        before the reply is known: use what it produced only if the future's LoadResult
        holds what that work assumed (its match.pages), else compute it again (a load that
        fails or finds less may have written some of the rows, or none). The future holds
        the result or the call's error. Where the daemon cannot be ordered with the stream
        by signal words (CPU workers, the embedded engine), this is `load`, in a future
        that is done."""
        return self._backend.post_load(self._packed(tokens, keys), _row_array(kv_rows), slot)

    def store(self, tokens: Any = None, *, keys: Keys | Chain | None = None, kv_rows: Sequence[int] = (),
              checkpoints: Mapping[int, int] | None = None, durable: bool = False,
              ready: Any = None, publish_tokens: bool = False, first_page: int = 0,
              synchronous: bool = False) -> StoreResult:
        """Store the prompt's pages from kv_rows and the checkpoints offered, {token position:
        state slot}, each position a multiple of the page size. With `durable`, return only
        once they are committed to disk (they survive the daemon crashing). GPU workers
        may pass `ready`, an interprocess CUDA event recorded after the rows were written
        (a store from another thread); by default one is recorded on the current stream.
        On a GPU, through a daemon, the store returns once its copies are queued, with
        the current stream waiting until they are done, so the rows may be written again
        on that stream at once (on another, after it): whatever the store returns or
        raises. With `synchronous`, it returns once the rows are copied out.
        With `publish_tokens`, the daemon's KV events carry the prompt's tokens (routers
        such as llm-d's indexer hash tokens themselves; without them, events carry keys).

        `first_page`: the store adds to a hit and sends only pages first_page+1.. (`keys`
        and `kv_rows` for those; given `tokens`, all of the prompt's, the keys are cut
        here); checkpoint positions still count from the start. Start at the hit's last
        page (hit - 1): that entry is cached already, and it anchors the new ones (their
        parent in KV events, the checkpoint their worth is counted from)."""
        pages = self._checkpoint_pages(checkpoints)
        request = self._store_request(tokens, keys, publish_tokens, first_page)
        return self._backend.store(request, _row_array(kv_rows), pages, durable, ready, synchronous)

    def post(self, tokens: Any = None, *, keys: Keys | Chain | None = None, kv_rows: Sequence[int] = (),
             checkpoints: Mapping[int, int] | None = None, publish_tokens: bool = False,
             first_page: int = 0) -> Future[StoreResult]:
        """Store through this worker's outbox (`Client.register(..., outbox_pages=N)`,
        tiercache/outbox.py), with `store`'s arguments: the rows and the checkpoints' slots
        are copied into the outbox on the current stream, and may be written again on that
        stream at once (on another, after it); the call to the daemon goes from a thread
        of the outbox's. The future holds its StoreResult, or its error; calls made after
        it is done see the entries. Without an outbox, or for a prompt it cannot hold,
        this is `store`, its result in a future that is done."""
        pages, rows = self._checkpoint_pages(checkpoints), _row_array(kv_rows)
        check_prompt(tokens, keys)  # now: the request is packed only once the copy is queued
        request = lambda: self._store_request(tokens, keys, publish_tokens, first_page)  # noqa: E731
        if self._outbox is not None and self._outbox.fits(rows, pages):
            return self._outbox.post(request, rows, pages)  # the request packed behind the copy
        done: Future[StoreResult] = Future()
        done.set_result(self._backend.store(request(), rows, pages, False))
        return done

    def _checkpoint_pages(self, checkpoints: Mapping[int, int] | None) -> dict[int, int]:
        """A store's checkpoints {token position: state slot} as {page: state slot}."""
        page = self.layout.page_tokens
        bad = [p for p in (checkpoints or {}) if p <= 0 or p % page]
        if bad:
            raise InvalidArgument(f"checkpoint position {bad[0]} is not a positive multiple of the "
                                  f"page size {page}: states are kept at page boundaries only")
        return {p // page: slot for p, slot in (checkpoints or {}).items()}

    def _store_request(self, tokens: Any, keys: Keys | Chain | None, publish_tokens: bool,
                       first_page: int) -> Request:
        request = self._packed(tokens, keys)
        if publish_tokens:
            if tokens is None:
                raise InvalidArgument("publish_tokens needs the tokens: store by tokens, not keys")
            whole = token_array(tokens)[:len(request.keys) // 16 * self.layout.page_tokens]
            request = replace(request, tokens=whole.tobytes())
        if first_page:
            cut, page = first_page if tokens is not None else 0, self.layout.page_tokens
            request = replace(request, keys=request.keys[16 * cut:], checks=request.checks[8 * cut:],
                              tokens=request.tokens[4 * page * cut:], first_page=first_page)
        return request

    def evict(self, tokens: Any = None, *, keys: Keys | Chain | None = None,
              tier: Tier | None = None) -> int:
        return self._backend.evict(self._packed(tokens, keys), tier)

    @property
    def connected(self) -> bool:
        """Whether the registration still stands. A daemon that went away cannot finish
        the copies of calls that already replied: if this turns False while some were
        still queued, the client releases the stream's waits on them once the daemon's
        process is gone, and those loads' rows hold what they held (README, Failures)."""
        return self._backend.connected()

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.close()  # its calls answered first: they may read the worker's rows
        self._backend.close()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _row_array(rows: Any) -> np.ndarray:
    """kv rows as int64, at once for a range, an array or a tensor (a list of 5,461 ints
    takes 30-70 us to convert, buffers.int_ids; the engine checks them against the buffers)."""
    if isinstance(rows, range):
        return np.arange(rows.start, rows.stop, rows.step, dtype=np.int64)
    given = isinstance(rows, (np.ndarray, list, tuple, torch.Tensor))
    return int_ids(rows if given else list(rows), "kv rows")


# -- over a daemon -----------------------------------------------------------------------
def _rows_fields(rows: np.ndarray, packed: bool) -> dict[str, Any]:
    """kv rows as a request's fields: kv_rows_packed (uint32 little-endian) for a daemon
    that reads it, else kv_rows."""
    bad = rows[(rows < 0) | (rows >= 1 << 32)]
    if bad.size:
        raise InvalidArgument(f"kv row {int(bad[0])} is out of range: rows count from 0")
    return {"kv_rows_packed": rows.astype("<u4").tobytes()} if packed else {"kv_rows": rows.tolist()}


def _ready_event(device: torch.device | None) -> torch.cuda.Event | None:
    """An event after everything queued so far on the current stream (in-process)."""
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _done(call: Callable[[], T]) -> Future[T]:
    """A future that is done: `call`'s result, or its error."""
    done: Future[T] = Future()
    try:
        done.set_result(call())
    except BaseException as error:  # noqa: BLE001 - the future holds it, as a posted call's would
        done.set_exception(error)
    return done


class _Remote:
    def __init__(self, stub: pb_grpc.TiercacheStub, worker_id: str, stream: Any,
                 shared: SharedBuffers | None, device: torch.device | None, timeout: float,
                 metadata: tuple[tuple[str, str], ...], packed: bool,
                 signals: WorkerSignals | None = None, daemon: tuple[int, int] | None = None,
                 ways: Sequence[Lane | CallStream] = ()) -> None:
        self._stub, self._id, self._stream = stub, worker_id, stream
        # Match, Load and Store as messages: in the worker's lane, on its stream of calls,
        # the first of them that takes the call (else it is a call of its own)
        self._ways = tuple(ways)
        self._packed = packed  # the daemon reads kv_rows_packed
        self._shared, self._device, self._timeout = shared, device, timeout
        self._call = {"timeout": timeout, "metadata": metadata}
        self._events = _Events(device)  # the ready events this worker hands the daemon
        self._done = OpenedEvents()  # the daemon's, for its asynchronous loads
        self.signals = signals  # where the daemon reads them (tiercache/signals.py)
        self._unsettled: list[pb.SettleRequest] = []  # calls to settle again (_watch)
        self._lock = threading.Lock()
        self._daemon = daemon  # (pid, start) where this process can see the daemon's process
        # a thread of its own, no callback from grpc's threads (workers crashed at exit so)
        self._watcher = threading.Thread(target=self._watch, name="tiercache-release", daemon=True)
        # waits for post_load's replies (and sends its calls where the stream was busy); its
        # thread starts at the first post
        self._posted = ThreadPoolExecutor(1, thread_name_prefix="tiercache-load")
        if signals is not None:
            self._watcher.start()

    def match(self, prompt: Request, prefetch: bool) -> Match:
        request = pb.MatchRequest(worker_id=self._id, keys=prompt.keys, checks=prompt.checks,
                                  prefetch=prefetch)
        return match_from_proto(self._sent("match", request, self._stub.Match).match)

    def load(self, prompt: Request, rows: np.ndarray, slot: int | None, synchronous: bool) -> LoadResult:
        asynchronous = self._device is not None and not synchronous
        with self._ordered(None, True, asynchronous) as (fields, sent, replied):
            request = self._load_request(prompt, rows, slot, asynchronous, **fields)
            reply = self._sent("load", request, self._stub.Load, sent)
            replied()
        result = load_from_proto(reply)
        if not request.asynchronous:
            return result
        stream = torch.cuda.current_stream(self._device)
        if reply.done_event:  # a daemon older than LoadRequest.done_event: its own event
            stream.wait_event(self._done.open(self._device, reply.done_event))
        # what callers may wait on from other streams: the copies are done when this
        # stream gets here (the pooled `done` is recorded again by later calls)
        return replace(result, done=stream.record_event())

    def _load_request(self, prompt: Request, rows: np.ndarray, slot: int | None, asynchronous: bool,
                      **fields: Any) -> pb.LoadRequest:
        return pb.LoadRequest(worker_id=self._id, keys=prompt.keys, checks=prompt.checks, slot=slot,
                              **fields, **_rows_fields(rows, self._packed), asynchronous=asynchronous)

    def post_load(self, prompt: Request, rows: np.ndarray, slot: int | None) -> Future[LoadResult]:
        if self.signals is None:
            return _done(lambda: self.load(prompt, rows, slot, False))
        self.check_registered()
        request = self._load_request(prompt, rows, slot, True)
        with self.signals.call() as call:  # the ready word, then the wait for the done word
            call.await_done()
        request.signal.slot, request.signal.value = call.slot, call.value
        done = torch.cuda.current_stream(self._device).record_event()
        reply = None
        try:  # sent from this thread where the stream is free: a thread's wake-up sooner
            reply = self._start("load", request)
            return self._posted.submit(self._load_posted, request, reply, call, done)
        except BaseException:  # (closed meanwhile) the call ends here, settled if it must be
            return _done(lambda: self._load_posted(request, reply, call, done))

    def _load_posted(self, request: pb.LoadRequest, reply: Callable[[], Any] | None, call: Call,
                     done: torch.cuda.Event) -> LoadResult:
        """A posted load's reply (`reply` waits for it where it went in the lane or on the
        stream of calls; else it is sent now), or its error, the call settled if no reply came."""
        with self._settled(call, awaited=True) as replied:
            answer = reply() if reply is not None else self._sent("load", request, self._stub.Load)
            replied()
        return replace(load_from_proto(answer), done=done)

    def store(self, prompt: Request, rows: np.ndarray, checkpoints: Mapping[int, int],
              durable: bool, ready: Any = None, synchronous: bool = False) -> StoreResult:
        asynchronous = not (synchronous or durable)  # a durable store replies once copied
        with self._ordered(ready, not synchronous, asynchronous) as (fields, sent, replied):
            result = self._stored(prompt, rows, checkpoints, durable, asynchronous, fields, sent)
            replied()
            return result

    def store_signalled(self, prompt: Request, rows: np.ndarray, checkpoints: Mapping[int, int],
                        call: Call) -> StoreResult:
        """An asynchronous store whose ready word is written and whose done word is waited
        for already (tiercache/outbox.py)."""
        with self._settled(call, awaited=True) as replied:
            fields = {"signal": pb.Signal(slot=call.slot, value=call.value)}
            result = self._stored(prompt, rows, checkpoints, False, True, fields)
            replied()
            return result

    def _stored(self, prompt: Request, rows: np.ndarray, checkpoints: Mapping[int, int],
                durable: bool, asynchronous: bool, fields: dict[str, Any],
                sent: Callable[[], None] | None = None) -> StoreResult:
        request = pb.StoreRequest(worker_id=self._id, keys=prompt.keys, checks=prompt.checks,
                                  durable=durable, event_tokens=prompt.tokens,
                                  asynchronous=asynchronous, first_page=prompt.first_page, **fields,
                                  **_rows_fields(rows, self._packed),
                                  checkpoints=[pb.Checkpoint(pages=n, slot=s)
                                               for n, s in sorted(checkpoints.items())])
        return store_from_proto(self._sent("store", request, self._stub.Store, sent))

    def _sent(self, kind: str, request: Any, call: Callable[..., T],
              sent: Callable[[], None] | None = None) -> T:
        """The reply to `request`: in the worker's lane or on its stream of calls, or as a
        call of its own (they are busy with other threads' calls, or the daemon takes none).
        `sent` runs once the request is on its way, before the wait for its reply."""
        reply = self._start(kind, request)
        if sent is not None:  # (if it raises, the lane stays busy: calls take the other ways)
            sent()
        if reply is not None:
            return reply()
        return answered(lambda: call(request, **self._call))

    def _start(self, kind: str, request: Any) -> Callable[[], Any] | None:
        """`request` put in the first of the worker's ways that takes it, and what waits for
        its reply; None when none does."""
        for way in self._ways:
            reply = way.start(kind, request, self._timeout)
            if reply is not None:
                return reply
        return None

    @contextmanager
    def _ordered(self, given: Any, awaited: bool, asynchronous: bool
                 ) -> Iterator[tuple[dict[str, Any], Callable[[], None], Callable[[], None]]]:
        """The request's fields that order its copies after the work queued on the current
        stream (or after the caller's `given` event) and, if `awaited`, that stream's later
        work after the copies; what to call once the request is on its way, before the
        wait for its reply (it writes the call's ready word: WorkerSignals.call, deferred);
        and what to call once the reply came.

        Where the daemon reads signal words (tiercache/signals.py), the stream waits on
        the call's done word wherever copies may still be queued: after an `asynchronous`
        reply, and after an error without a reply (the call is then settled: the daemon
        writes the word, after the call's copies if it handled it). If the daemon dies
        with the word unwritten, this worker writes it itself (`_watch`). Without words,
        the stream waits on an event of its own that the daemon records after the copies
        (a wait for nothing if it never recorded it, but forever if it died with the
        record queued)."""
        signals = self.signals
        if signals is None:
            with self._events.marked(given) as ready, self._events.awaited(awaited) as done:
                yield {"ready_event": ready, "done_event": done}, lambda: None, lambda: None
            return
        self.check_registered()
        with signals.call(given, deferred=True) as call:
            with self._settled(call, awaited=False) as replied:
                yield {"signal": pb.Signal(slot=call.slot, value=call.value)}, call.ready, replied
            if asynchronous:
                call.await_done()

    @contextmanager
    def _settled(self, call: Call, awaited: bool) -> Iterator[Callable[[], None]]:
        """If the block raises, the call's stream waits on its done word (unless `awaited`
        already: some of its copies may be queued, and the word comes after them), and a
        call that got no reply (the block did not call what it was given) is settled."""
        replied: list[bool] = []
        try:
            yield lambda: replied.append(True)
        except BaseException:
            if not awaited:
                call.await_done()
            if not replied:
                self._settle(pb.SettleRequest(worker_id=self._id, signal=pb.Signal(
                    slot=call.slot, value=call.value)))
            raise

    def check_registered(self) -> None:
        """Raise if the registration has ended: a call would take a signal word that, with
        the daemon gone, no one might write (the watch thread may have ended)."""
        if self._stream.done():
            raise Unavailable("this worker's registration has ended (the daemon went away or "
                              "closed it): register again")

    def _settle(self, request: pb.SettleRequest) -> None:
        """Ask the daemon to settle a call whose reply did not come; until it answers, the
        call is asked again (`_watch`). A daemon that no longer holds this registration
        has none of its copies queued, nor ever will: the worker writes the word itself,
        as it does once the daemon's process is gone."""
        try:
            self._stub.Settle(request, **self._call)
        except Exception as error:  # grpc's errors, or its channel closed (ValueError)
            if isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.NOT_FOUND:
                self.signals.release_one(request.signal.slot, request.signal.value)
            elif not self._watcher.is_alive() and self._daemon_gone():
                self.signals.release_one(request.signal.slot, request.signal.value)
            else:
                with self._lock:
                    self._unsettled.append(request)

    def _daemon_gone(self) -> bool:
        """Whether the daemon's process is known to have ended (never, where this process
        cannot see it)."""
        return self._daemon is not None and process_started(self._daemon[0]) != self._daemon[1]

    def _settle_again(self) -> None:
        with self._lock:
            unsettled, self._unsettled = self._unsettled, []
        for request in unsettled:
            self._settle(request)

    def _watch(self) -> None:
        """Settle again the calls that could not be settled. Once the registration stream
        ended and the daemon's process is gone, write the done words this worker's
        streams still wait on (its queued copies will never run). A daemon this process
        cannot see is never known to be gone (README, Failures)."""
        while not self._stream.done():
            self._settle_again()
            time.sleep(0.1)
        signals, daemon = self.signals, self._daemon
        if signals is None or daemon is None:
            return
        while not self._daemon_gone():
            self._settle_again()
            if not signals.waiting():
                return
            time.sleep(0.05)
        with self._lock:
            self._unsettled = []
        released = signals.release()
        if released:
            log.warning("the daemon (pid %d) died with the copies of %d calls of this worker "
                        "queued: their waits are released; the rows of those loads hold what "
                        "they held before, and their stores were not kept", daemon[0], released)

    def evict(self, prompt: Request, tier: Tier | None) -> int:
        request = pb.EvictRequest(worker_id=self._id, keys=prompt.keys, tier=int(tier or 0))
        return answered(lambda: self._stub.Evict(request, **self._call)).evicted

    def connected(self) -> bool:
        return not self._stream.done()  # the registration stream ends with the daemon

    def close(self) -> None:
        self._posted.shutdown(wait=True)  # the loads posted so far sent and answered first
        if self.signals is not None and not self._stream.done():
            # the daemon releases the waits of a registration that ends: let this worker's
            # own work before them finish first (or its copies could run before it)
            torch.cuda.current_stream(self._device).synchronize()
        for way in self._ways:
            way.close()
        self._stream.cancel()  # ends the registration: the daemon unmaps the buffers
        if self._watcher.is_alive():  # its words released first, if the daemon died:
            self._watcher.join()  # freeing them waits for every stream that waits on them
        for owned in (self._shared, self.signals):
            if owned is not None:
                owned.close()


class Client:
    """A connection to a tiercache daemon (`unix:PATH` or `host:port`).

    A worker's Match, Load and Store go as messages through shared memory of its own (its
    lane, tiercache/lane.py) where the daemon is on this node and takes them, else on one
    stream of its own (tiercache/call_stream.py); `lanes=False` leaves the lane out,
    `streamed_calls=False` the stream, and without both each is a call of its own."""

    def __init__(self, address: str | None = None, timeout: float = 30.0,
                 max_message_bytes: int = 16 << 20, token: str | None = None,
                 tls: Tls | None = None, handover: str | None = None,
                 streamed_calls: bool = True, lanes: bool = True) -> None:
        connection = connect(address, max_message_bytes, token, tls)
        self.address = connection.address
        self.timeout = timeout
        self.streamed_calls = streamed_calls
        self.lanes = lanes
        # where CPU workers hand their shared memory over: beside the daemon's Unix socket
        self.handover = handover or os.environ.get("TIERCACHE_HANDOVER") or (
            self.address.removeprefix("unix:") + ".fds" if self.address.startswith("unix:") else None)
        self._metadata = connection.metadata
        self._channel = connection.channel
        self._stub = pb_grpc.TiercacheStub(self._channel)
        self._regions: list[SharedRegion] = []

    def shared_region(self, nbytes: int) -> torch.Tensor:
        """A zeroed uint8 CPU tensor in shared memory, kept until `close`: CPU buffers of
        several registrations that must overlap are views into one region."""
        region = SharedRegion(nbytes)
        self._regions.append(region)
        return region.tensor

    def register(self, model_id: str, layout: Layout, extra_keys: Sequence[str] = (),
                 hash_name: str = "xxh3_128", buffers: Mapping[str, torch.Tensor] | None = None,
                 group: GroupMember | None = None, outbox_pages: int = 0,
                 outbox_checkpoints: int = 1) -> Worker:
        """Register a worker. Without `buffers`, the layout's buffers are allocated in
        shared memory (worker.paged / worker.slots); GPU workers pass their CUDA tensors,
        CPU workers views into a `shared_region`. With `group`, this is one rank of it.

        A GPU worker may ask for an outbox of `outbox_pages` pages and `outbox_checkpoints`
        checkpoints (tiercache/outbox.py, `Worker.post`): that much more GPU memory of its
        own, and a second registration with the daemon."""
        if outbox_pages and (buffers is None or not all(t.is_cuda for t in buffers.values())
                             or group is not None):
            raise InvalidArgument("an outbox is for a GPU worker that is not a group's rank: pass "
                                  "CUDA buffers and no group, or outbox_pages=0")
        worker = self._registered(model_id, layout, extra_keys, hash_name, buffers, group)
        if outbox_pages:
            try:
                worker._outbox = self._outbox(worker, model_id, extra_keys, outbox_pages, outbox_checkpoints)
            except BaseException:
                worker.close()
                raise
        return worker

    def _outbox(self, worker: Worker, model_id: str, extra_keys: Sequence[str], pages: int,
                checkpoints: int) -> Outbox | None:
        boxed = outbox_layout(worker.layout, pages, checkpoints)
        tensors = {**worker.paged, **worker.slots}
        buffers = device_buffers(boxed, next(iter(tensors.values())).device)
        box = self._registered(model_id, boxed, extra_keys, worker.hash_name, buffers, None)
        sender = box._backend
        if not isinstance(sender, _Remote) or sender.signals is None:
            box.close()
            log.warning("no outbox: the daemon or this GPU's driver has no signal words "
                        "(tiercache/signals.py); Worker.post stores as Worker.store does")
            return None
        if box.root != worker.root:  # the same identity, model and layout: never seen
            box.close()
            raise InvalidArgument("the outbox's registration landed in another namespace")
        return Outbox(sender, worker.layout, tensors, buffers, boxed)

    def _registered(self, model_id: str, layout: Layout, extra_keys: Sequence[str], hash_name: str,
                    buffers: Mapping[str, torch.Tensor] | None, group: GroupMember | None) -> Worker:
        shared, device = None, None
        if buffers is not None and all(t.device.type == "cpu" for t in buffers.values()):
            tensors, locations = dict(buffers), region_locations(buffers, self._handover())
        elif buffers is None:
            shared = SharedBuffers.create(layout)
            tensors = shared.tensors
            ticket = shared.hand_over(self._handover())
            locations = [pb.BufferLocation(name=p.spec.name, nbytes=p.nbytes,
                                           shm=pb.SharedMemoryBuffer(ticket=ticket, offset=p.offset))
                         for p in shared.placements]
        else:
            tensors, locations = dict(buffers), _cuda_locations(buffers)
            device = next(iter(tensors.values())).device
        signals = _signals(device)
        request = pb.RegisterRequest(model_id=model_id, layout=layout_to_proto(layout),
                                     extra_keys=extra_keys, hash=hash_name, buffers=locations,
                                     group=group.to_proto() if group is not None else None,
                                     signals=_signals_location(signals))
        try:
            stream: Iterator[pb.RegisterResponse] = self._stub.Register(request,
                                                                      metadata=self._metadata)
            reply = answered(lambda: next(stream))
        except (TiercacheError, StopIteration) as error:
            for owned in (shared, signals):
                if owned is not None:
                    owned.close()
            if isinstance(error, StopIteration):
                raise Unavailable(f"the daemon at {self.address} closed the registration") from None
            raise
        if signals is not None and not reply.reads_signals:  # an older daemon: events only
            signals.close()
            signals = None
        seen = reply.pid and process_started(reply.pid) == reply.started
        ways: list[Lane | CallStream] = []
        if self.lanes and reply.takes_lanes and self.handover is not None:
            lane = self._lane(reply.worker_id, alive=lambda: not stream.done())
            ways += [lane] if lane is not None else []
        if self.streamed_calls and reply.takes_calls:
            ways.append(CallStream(lambda requests: self._stub.Calls(requests, metadata=self._metadata)))
        backend = _Remote(self._stub, reply.worker_id, stream, shared, device, self.timeout,
                          self._metadata, reply.reads_packed_rows, signals,
                          (reply.pid, reply.started) if seen else None, ways)
        return Worker(backend, layout, PageKey(reply.namespace_root), reply.hash, tensors)

    def _lane(self, worker_id: str, alive: Callable[[], bool]) -> Lane | None:
        """A lane of calls for the worker just registered, handed over and opened; None if
        the daemon would not take it (the worker's calls then go on its stream)."""
        lane = None
        try:
            lane = Lane(alive)
            ticket = lane.hand_over(self._handover())
            answered(lambda: self._stub.OpenLane(pb.OpenLaneRequest(
                worker_id=worker_id, lane=pb.SharedMemoryBuffer(ticket=ticket)),
                timeout=self.timeout, metadata=self._metadata))
        except (TiercacheError, OSError) as error:  # OSError: no memfd for it
            if lane is not None:
                lane.close()
            log.warning("no lane of calls for worker %s (its calls go on its stream): %s",
                        worker_id, error)
            return None
        return lane

    def _handover(self) -> str:
        if self.handover is None:
            raise InvalidArgument("shared-memory buffers are handed over on the daemon's Unix "
                                  "socket: connect to unix:PATH, or pass handover=PATH.fds")
        return self.handover

    def group(self, group_id: str, timeout: float | None = None) -> Group:
        """The group `group_id` as the daemon describes it now (NotFound before any rank
        registered), for matching on behalf of all its ranks."""
        return Group(self._stub, group_id, self.timeout if timeout is None else timeout,
                     self._metadata)

    def stats(self) -> CacheStats:
        reply = answered(lambda: self._stub.Stats(pb.StatsRequest(), timeout=self.timeout,
                                                  metadata=self._metadata))
        return CacheStats(tuple(tier_stats_from_proto(t) for t in reply.tiers), dict(reply.counters),
                          reply.workers)

    def close(self) -> None:
        self._channel.close()
        for region in self._regions:
            region.close()
        self._regions.clear()


def _cuda_locations(buffers: Mapping[str, torch.Tensor]) -> list[pb.BufferLocation]:
    if not all(t.is_cuda for t in buffers.values()):
        raise InvalidArgument("buffers passed to register must be CUDA tensors; for CPU workers "
                              "register without buffers and compute in worker.paged / worker.slots "
                              "(shared memory the daemon can map)")
    from tiercache import cuda_ipc  # needs cuda-bindings: GPU machines only
    return [_cuda_location(name, cuda_ipc.export(tensor)) for name, tensor in buffers.items()]


def _signals(device: torch.device | None) -> WorkerSignals | None:
    """A GPU worker's signal words, or None (interprocess events then, as with an older
    daemon) where the driver has no stream memory operations."""
    if device is None:
        return None
    try:
        return WorkerSignals(device)
    except RuntimeError as error:
        log.warning("this GPU's driver cannot wait on memory (%s): copies are ordered by "
                    "interprocess events, which a crashed daemon never completes "
                    "(README, Failures)", error)
        return None


def _signals_location(signals: WorkerSignals | None) -> pb.BufferLocation | None:
    return None if signals is None else _cuda_location("signals", signals.exported)


def _cuda_location(name: str, exported: Any) -> pb.BufferLocation:
    return pb.BufferLocation(name=name, nbytes=exported.nbytes, cuda=pb.CudaIpcBuffer(
        handle=exported.handle, offset=exported.offset, device_uuid=exported.device_uuid))


class _Events:
    """The interprocess events that tell the daemon where a worker's stream stands,
    reused from call to call (the daemon opens each once, as the client does the
    daemon's done events: cuda_ipc.OpenedEvents): creating and exporting one per call,
    and opening it in the other process, cost a few hundred microseconds a call more
    than recording one again (an H100 host, RESULTS.md)."""

    def __init__(self, device: torch.device | None) -> None:
        self._device = device
        self._free: list[tuple[torch.cuda.Event, bytes]] = []
        self._lock = threading.Lock()

    @contextmanager
    def marked(self, given: torch.cuda.Event | None = None) -> Iterator[bytes]:
        """The handle of an event recorded after all work queued so far on the current
        stream (or of the caller's own `given` event); b"" for a worker without a GPU.
        No other call records the event until the block ends: the daemon queues its wait
        on it before it replies."""
        if given is not None or self._device is None:
            yield given.ipc_handle() if given is not None else b""
            return
        with self._taken() as (_, handle):
            yield handle

    @contextmanager
    def awaited(self, wanted: bool = True) -> Iterator[bytes]:
        """The handle of an event for the daemon to record after a call's copies, which may
        still run after its reply, or after the call failed (b"" without a GPU, or if not
        `wanted`). When the block ends, however it ends, the current stream waits on the
        event's latest record: the daemon's, or this one's, a wait for nothing, if it
        recorded none."""
        if not wanted or self._device is None:
            yield b""
            return
        with self._taken() as (event, handle):
            try:
                yield handle
            finally:
                torch.cuda.current_stream(self._device).wait_event(event)

    @contextmanager
    def _taken(self) -> Iterator[tuple[torch.cuda.Event, bytes]]:
        """A free event of this worker's, recorded on the current stream, and its handle."""
        with self._lock:
            event, handle = self._free.pop() if self._free else (None, b"")
        if event is None:
            event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(self._device))
        handle = handle or event.ipc_handle()
        try:
            yield event, handle
        finally:
            with self._lock:
                self._free.append((event, handle))


# -- in-process ------------------------------------------------------------------------
def _checks(prompt: Request) -> np.ndarray | None:
    return np.frombuffer(prompt.checks, "<u8") if prompt.checks else None


class _Embedded:
    def __init__(self, engine: Engine, buffers: WorkerBuffers) -> None:
        self._engine, self._buffers = engine, buffers

    def match(self, prompt: Request, prefetch: bool) -> Match:
        return self._engine.match(self._buffers.layout, prompt.keys, prefetch=prefetch,
                                  checks=_checks(prompt), buffers=self._buffers)

    def load(self, prompt: Request, rows: np.ndarray, slot: int | None, synchronous: bool) -> LoadResult:
        device = self._buffers.device if self._buffers.device.type == "cuda" else None
        result = self._engine.load(self._buffers, prompt.keys, rows, slot, ready=_ready_event(device),
                                   asynchronous=device is not None and not synchronous,
                                   checks=_checks(prompt))
        if result.done is not None:
            torch.cuda.current_stream(device).wait_event(result.done)
        return result

    def post_load(self, prompt: Request, rows: np.ndarray, slot: int | None) -> Future[LoadResult]:
        return _done(lambda: self.load(prompt, rows, slot, False))

    def store(self, prompt: Request, rows: np.ndarray, checkpoints: Mapping[int, int],
              durable: bool, ready: Any = None, synchronous: bool = False) -> StoreResult:
        """In process, a store always returns once the rows are copied out."""
        device = self._buffers.device if self._buffers.device.type == "cuda" else None
        ready = ready if ready is not None else _ready_event(device)
        return self._engine.store(self._buffers, prompt.keys, rows, checkpoints,
                                  ready=ready, checks=_checks(prompt),
                                  durable=durable, first_page=prompt.first_page)

    def evict(self, prompt: Request, tier: Tier | None) -> int:
        return self._engine.evict(prompt.keys, tier)

    def connected(self) -> bool:
        return True

    def close(self) -> None:
        pass


class EmbeddedClient:
    """The same API with the engine in this process: no daemon, no shared memory."""

    def __init__(self, engine: Engine | EngineConfig | None = None) -> None:
        from tiercache.engine import Engine, EngineConfig
        self.engine = engine if isinstance(engine, Engine) else Engine.open(engine or EngineConfig())

    def register(self, model_id: str, layout: Layout, extra_keys: Sequence[str] = (),
                 hash_name: str = "xxh3_128",
                 buffers: Mapping[str, torch.Tensor] | None = None) -> Worker:
        """Register the layout with `buffers` (by name), or with new zeroed CPU tensors."""
        specs = (*layout.paged, *layout.slots)
        tensors = dict(buffers) if buffers is not None else {
            b.name: torch.zeros(b.shape, dtype=getattr(torch, b.dtype)) for b in specs}
        paged = {b.name for b in layout.paged}
        bound = WorkerBuffers.bind(layout, {n: t for n, t in tensors.items() if n in paged},
                                   {n: t for n, t in tensors.items() if n not in paged})
        namespace = Namespace(model_id, layout.fingerprint, "", tuple(extra_keys), hash_name)
        self.engine.prepare(bound)
        return Worker(_Embedded(self.engine, bound), layout, namespace.root(), hash_name, tensors)

    def stats(self) -> CacheStats:
        stats = self.engine.stats()
        return CacheStats(stats.tiers, stats.counters, 0)

    def close(self) -> None:
        self.engine.close()
