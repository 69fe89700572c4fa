"""The gRPC servicer: validate, convert, delegate to the engine, convert back. Errors are
raised as tiercache errors and turned into status codes by service.errors."""

from __future__ import annotations

import os
import threading
from contextlib import AbstractContextManager, contextmanager
from typing import Iterator

import grpc
import numpy as np
import torch

from tiercache_service import calls, lanes
from tiercache_service.auth import Authenticator
from tiercache_service.groups import GroupRegistry, describe_to_proto
from tiercache_service.fleet import Fleet
from tiercache_service.lookups import Lookups
from tiercache_service.workers import Registration, WorkerRegistry
from tiercache import trace
from tiercache.engine import Engine
from tiercache.errors import DeadlineExceeded, InvalidArgument
from tiercache.hashing import KEY_BYTES
from tiercache.signals import process_started
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc
from tiercache.wire import (load_to_proto, match_to_proto, store_to_proto, tier_from_proto,
                            tier_stats_to_proto)


def _event(handle: bytes, worker: Registration, field: str = "ready_event") -> torch.cuda.Event | None:
    """The worker's interprocess CUDA event named by `handle`, if any, opened once per
    registration (its client reuses a few: tiercache/client.py)."""
    if not handle:
        return None
    device = worker.buffers.device if worker.buffers is not None else None
    if device is None or device.type != "cuda":
        raise InvalidArgument(f"{field} is for workers whose buffers are on a GPU")
    try:
        return worker.events.open(device, handle)
    except RuntimeError as error:
        raise InvalidArgument(f"{field} is not a CUDA IPC event handle: {error}") from None


@contextmanager
def _ordered(request: pb.LoadRequest | pb.StoreRequest, worker: Registration
             ) -> Iterator[tuple[object | None, object | None, bool]]:
    """What the call's copies wait on before they touch the worker's rows (its ready word,
    or its ready event), what marks them done (its done word, or its done event), and
    whether it signals. A signalled call's done word is written when the block ends if no
    copy wrote it (tiercache/signals.py): the engine leaves no copy queued when it raises."""
    if not request.HasField("signal"):
        yield (_event(request.ready_event, worker),
               _event(request.done_event, worker, "done_event"), False)
        return
    if worker.signals is None:
        raise InvalidArgument("signal names words of RegisterRequest.signals: this worker "
                              "registered none")
    if request.ready_event or request.done_event:
        raise InvalidArgument("give ready_event and done_event, or signal, not both")
    with worker.signals.call(request.signal.slot, request.signal.value) as (ready, done):
        yield ready, done, True


_DONE_EVENTS = 4  # events a worker's asynchronous loads hand back, in turn
_done_lock = threading.Lock()


def _done_event(worker: Registration) -> torch.cuda.Event:
    """The next of the worker's own interprocess events for an asynchronous load to
    record its end into. Recorded again by later loads of the same worker only (a wait
    queued after that waits for a later copy of the same stream: longer, never too
    short); the daemon knows a load is done by an event of its own (tiercache/load.py)."""
    with _done_lock:
        if len(worker.done_events) < _DONE_EVENTS:
            with torch.cuda.device(worker.buffers.device):
                worker.done_events.append(torch.cuda.Event(interprocess=True))
        worker.done_events.append(event := worker.done_events.pop(0))
    return event


# A store copies worker rows, and a load writes them, only while the worker still waits
# for the reply: once its deadline passes, it may write those rows itself. The daemon's
# clock for the deadline starts when the call arrives, after the worker's, so it stops
# this much earlier.
_DEADLINE_MARGIN = 0.05


def _waiting(context: grpc.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return context.is_active() and (remaining is None or remaining > _DEADLINE_MARGIN)


def _next_message(messages: Iterator[pb.CallRequest]) -> pb.CallRequest | None:
    """A Calls stream's next message; None once it ended: its client closed or left, or
    it was cancelled (a newer stream of its worker, the registration's end, the daemon
    stopping): a normal end, not a failure to log."""
    try:
        return next(messages)
    except (StopIteration, grpc.RpcError):
        return None


class TiercacheServicer(pb_grpc.TiercacheServicer):
    def __init__(self, engine: Engine, registry: WorkerRegistry, max_prompt_pages: int,
                 auth: Authenticator | None = None, fleet: Fleet | None = None,
                 lookups: Lookups | None = None) -> None:
        self.engine = engine
        self.lookups = lookups or Lookups()  # Match and Load, by call and model (service/lookups.py)
        self.fleet = fleet or Fleet()  # the remote tier and KV events (service/fleet.py)
        self.registry = registry
        self.max_prompt_pages = max_prompt_pages
        self.auth = auth or Authenticator({})
        self.stopping = threading.Event()
        self.groups = GroupRegistry(engine, registry)
        self.observe: calls.Observe = lambda *ended: None  # each Calls message's end (server.py)
        self._binding = threading.Lock()  # a worker's Calls stream, bound once
        self._handlers = {"match": self._match, "load": self._load, "store": self._store}

    def _worker(self, worker_id: str, context: grpc.ServicerContext
                ) -> AbstractContextManager[Registration]:
        """The caller's registration `worker_id`: the caller must be who registered it."""
        return self.registry.use(worker_id, self.auth.identify(context))

    def _keys(self, data: bytes, context: grpc.ServicerContext) -> np.ndarray:
        """Check the deadline and the keys of a request; the keys as a uint64 (n, 2) array."""
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded("the deadline passed before the call started: nothing was done")
        if not data:
            raise InvalidArgument("the prompt has no full page: nothing to match, load or store")
        if len(data) % KEY_BYTES:
            raise InvalidArgument(f"keys are {KEY_BYTES} bytes each: {len(data)} bytes is not a "
                                  "whole number of keys")
        if len(data) // KEY_BYTES > self.max_prompt_pages:
            raise InvalidArgument(f"{len(data) // KEY_BYTES} pages exceed the limit of "
                                  f"{self.max_prompt_pages} per request: split the prompt")
        return np.frombuffer(data, "<u8").reshape(-1, 2)

    @staticmethod
    def _checks(data: bytes, keys: np.ndarray) -> np.ndarray | None:
        """The checks of a request (8 bytes per key), or None when it sent none."""
        if not data:
            return None
        if len(data) != 8 * len(keys):
            raise InvalidArgument(f"checks are 8 bytes per key: got {len(data)} bytes for "
                                  f"{len(keys)} keys")
        return np.frombuffer(data, "<u8")

    @staticmethod
    def _rows(request: pb.LoadRequest | pb.StoreRequest) -> np.ndarray:
        """A request's page rows: kv_rows, or kv_rows_packed (4 bytes each), not both."""
        packed = request.kv_rows_packed
        if not packed:
            return np.asarray(request.kv_rows, np.int64)
        if len(request.kv_rows):
            raise InvalidArgument("give kv_rows or kv_rows_packed, not both")
        if len(packed) % 4:
            raise InvalidArgument(f"kv_rows_packed is 4 bytes per row: got {len(packed)} bytes")
        return np.frombuffer(packed, "<u4").astype(np.int64)

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext
                 ) -> Iterator[pb.RegisterResponse]:
        identity = self.auth.identify(context)
        registration = self.registry.add(request, identity, self.auth.hash_of(identity.tenant))
        try:
            if registration.group is not None:
                self.groups.join(registration)
            self.engine.prepare(registration.buffers)  # on a GPU: the copy kernels, loaded now
        except Exception:
            self.registry.remove(registration.id)
            raise
        # the stream's end, for whatever reason (worker gone, unregister, shutdown), unregisters
        if not context.add_callback(lambda: self.registry.remove(registration.id)):
            self.registry.remove(registration.id)  # the call ended already
            return
        namespace = registration.namespace
        yield pb.RegisterResponse(worker_id=registration.id, namespace_root=registration.root,
                                  reads_packed_rows=True, takes_calls=True,
                                  layout_fingerprint=namespace.layout_fingerprint,
                                  hash=namespace.hash_name,
                                  reads_signals=registration.signals is not None,
                                  pid=os.getpid(), started=process_started(os.getpid()) or 0,
                                  takes_lanes=True)
        while not registration.gone.wait(1.0) and not self.stopping.is_set() and context.is_active():
            pass

    def Unregister(self, request: pb.UnregisterRequest, context: grpc.ServicerContext
                   ) -> pb.UnregisterResponse:
        with self._worker(request.worker_id, context):  # raises NotFound or PermissionDenied
            pass
        self.registry.remove(request.worker_id)
        return pb.UnregisterResponse()

    def Match(self, request: pb.MatchRequest, context: grpc.ServicerContext) -> pb.MatchResponse:
        with trace.call("Match"):  # a breakdown, when TIERCACHE_TRACE asks for one
            return self._match(request, context)

    def _match(self, request: pb.MatchRequest, context: grpc.ServicerContext) -> pb.MatchResponse:
        keys = self._keys(request.keys, context)
        checks = self._checks(request.checks, keys)
        if request.group:  # a caller without buffers (vLLM's scheduler) asks for a group
            tenant = self.auth.identify(context).tenant
            match = self.groups.match(tenant, request.group, keys, checks, request.prefetch)
            model = self.groups.describe(tenant, request.group).model_id
        else:
            with self._worker(request.worker_id, context) as worker:
                if worker.group is not None:  # a rank answers for its whole group
                    match = self.groups.match(worker.identity.tenant, worker.group.id, keys,
                                              checks, request.prefetch)
                else:
                    match = self.engine.match(worker.layout, worker.engine_keys(keys),
                                              prefetch=request.prefetch, checks=checks,
                                              scope=worker.identity.tenant, buffers=worker.buffers)
                model = worker.namespace.model_id
        self.lookups.matched(model, request.keys, match.prompt_pages, match.pages)
        return pb.MatchResponse(match=match_to_proto(match))

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadResponse:
        with trace.call("Load"):  # a breakdown, when TIERCACHE_TRACE asks for one
            return self._load(request, context)

    def _load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadResponse:
        with trace.span("request"):
            keys = self._keys(request.keys, context)
            checks = self._checks(request.checks, keys)
            rows = self._rows(request)
        with self._worker(request.worker_id, context) as worker:
            slot = request.slot if request.HasField("slot") else None
            # copies into CPU workers are synchronous anyway
            asynchronous = request.asynchronous and worker.buffers.device.type == "cuda"
            with _ordered(request, worker) as (ready, given, _):
                # what marks the copies done: the worker's done word or its own done
                # event; else, for an asynchronous load, an event of ours, handed back
                # in the reply
                hand_back = given is None and asynchronous
                done = _done_event(worker) if hand_back else given
                result = self.engine.load(worker.buffers, worker.engine_keys(keys), rows, slot,
                                          ready=ready, asynchronous=asynchronous, checks=checks,
                                          done_event=done, alive=lambda: _waiting(context),
                                          scope=worker.identity.tenant)
            # the pages it could take: as many as its rows, or the prompt without paged buffers
            asked = min(len(keys), len(rows)) if worker.layout.needs_pages else len(keys)
            self.lookups.loaded(worker.namespace.model_id, request.keys, asked, result.match.pages)
        return load_to_proto(result, hand_back=hand_back)

    def Store(self, request: pb.StoreRequest, context: grpc.ServicerContext) -> pb.StoreResponse:
        with trace.call("Store"):  # a breakdown, when TIERCACHE_TRACE asks for one
            return self._store(request, context)

    def _store(self, request: pb.StoreRequest, context: grpc.ServicerContext) -> pb.StoreResponse:
        with trace.span("request"):
            keys = self._keys(request.keys, context)
            checkpoints = {c.pages: c.slot for c in request.checkpoints}
            if len(checkpoints) != len(request.checkpoints):
                raise InvalidArgument("two checkpoints are offered at the same page: offer one per page")
            checks = self._checks(request.checks, keys)
            rows = self._rows(request)
        with self._worker(request.worker_id, context) as worker:
            keys = worker.engine_keys(keys)
            shared = self.fleet.before_store(worker, keys, request.event_tokens)
            with _ordered(request, worker) as (ready, done, signalled):
                if signalled and not request.asynchronous:  # reply once copied: the
                    done = None  # done word is written when the call ends
                result = self.engine.store(worker.buffers, keys, rows, checkpoints, ready=ready,
                                           checks=checks, alive=lambda: _waiting(context),
                                           durable=request.durable,
                                           timeout=context.time_remaining(), remote=shared,
                                           first_page=request.first_page, done_event=done,
                                           scope=worker.identity.tenant)
        return store_to_proto(result)

    def Calls(self, requests: Iterator[pb.CallRequest], context: grpc.ServicerContext
              ) -> Iterator[pb.CallReply]:
        """A worker's calls as messages of one stream (service/calls.py)."""
        bound: Registration | None = None
        messages = iter(requests)
        try:
            while (message := _next_message(messages)) is not None:
                kind = message.WhichOneof("call")
                if kind is None:
                    raise InvalidArgument("a CallRequest names no call: give match, load or store")
                worker_id = getattr(message, kind).worker_id
                if bound is None:
                    bound = self._bind(worker_id, context)
                elif worker_id != bound.id:
                    raise InvalidArgument(f"this stream carries worker {bound.id!r}'s calls: open "
                                          f"one for worker {worker_id!r}")
                yield self._answer(message, kind, context)
        finally:
            if bound is not None:
                with self._binding:
                    if bound.calls == context.cancel:  # not yet bound to a newer stream
                        bound.calls = None

    def OpenLane(self, request: pb.OpenLaneRequest, context: grpc.ServicerContext
                 ) -> pb.OpenLaneResponse:
        """A worker's lane of calls (service/lanes.py), answered as this call's caller."""
        try:
            with self._worker(request.worker_id, context) as worker:
                mapping = self.registry.give_lane(worker, request.lane.ticket)
                lanes.serve(mapping, lanes.Opener.of(context, worker), self._answer, self.stopping)
        except BaseException:
            self.registry.discard_ticket(request.lane.ticket)  # spent by a failed call too
            raise
        return pb.OpenLaneResponse()

    def _answer(self, message: pb.CallRequest, kind: str, context: calls.Caller) -> pb.CallReply:
        """The reply to one message of a stream or a lane of calls."""
        with trace.call(calls.METHODS[kind]):
            return calls.answer(message, kind, self._handlers[kind], context, self.observe)

    def _bind(self, worker_id: str, context: grpc.ServicerContext) -> Registration:
        """The registration a Calls stream carries the calls of, now bound to it."""
        with self._worker(worker_id, context) as worker, self._binding:
            if worker.calls is not None:
                worker.calls()  # its client gave up on it (a call's timeout): ended
            worker.calls = context.cancel  # the registry ends the stream with the registration
        return worker

    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictResponse:
        keys = self._keys(request.keys, context)
        with self._worker(request.worker_id, context) as worker:
            evicted = self.engine.evict(worker.engine_keys(keys), tier_from_proto(request.tier),
                                        scope=worker.identity.tenant)
        return pb.EvictResponse(evicted=evicted)

    def Settle(self, request: pb.SettleRequest, context: grpc.ServicerContext) -> pb.SettleResponse:
        with self._worker(request.worker_id, context) as worker:
            if worker.signals is None:
                raise InvalidArgument("Settle is for calls with a signal: this worker registered "
                                      "no signal words")
            if not request.HasField("signal"):
                raise InvalidArgument("give the signal of the call to settle")
            handled = worker.signals.settle(request.signal.slot, request.signal.value)
        return pb.SettleResponse(handled=handled)

    def DescribeGroup(self, request: pb.DescribeGroupRequest, context: grpc.ServicerContext
                      ) -> pb.DescribeGroupResponse:
        tenant = self.auth.identify(context).tenant  # groups are looked up in the caller's tenant
        return describe_to_proto(self.groups.describe(tenant, request.group))

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        # figures of every tenant together: callers must be known; the caller's own stores
        # that replied are counted (another tenant's still copying may not be yet)
        stats = self.engine.stats(scope=self.auth.identify(context).tenant)
        counters = {**stats.counters, **self.lookups.flat(),
                    "ipc_allocations": self.registry.ipc_allocations()}
        if self.engine.disk is not None:  # the disk budget is a share of it (`tiercache stats`)
            counters["disk_map_bytes"] = self.engine.disk.config.map_size
        return pb.StatsResponse(tiers=[tier_stats_to_proto(t) for t in stats.tiers],
                                counters=counters, workers=len(self.registry))
