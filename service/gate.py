"""The door every call passes: who is calling, whether they have room, and how long they
may take to say what they want.

grpc-python's own limit (`maximum_concurrent_rpcs`) counts a call from its first byte,
before it has sent its request or shown who it is, and it waits for the request on a
thread of the pool: a hundred calls that never send one would take every call slot and
shut every tenant and every probe out. So the gate takes the request off grpc's hands:

- each method is served as if its request were a stream, so the gate runs as soon as a
  call arrives, before its request: it checks the caller's credentials first (a call
  without valid ones ends at once, UNAUTHENTICATED, holding nothing);
- a call then takes a slot of its tenant (`per_tenant`) and of the daemon (`total`),
  or ends RESOURCE_EXHAUSTED: one tenant's calls, stalled or not, never take another
  tenant's room; health checks have slots of their own (`HEALTH_CALLS`, at most
  `HEALTH_PER_PEER` per remote address), so no cache call waits behind them or they
  behind cache calls;
- a call that has not sent its request within `request_seconds` is cancelled.

A registration holds its slot only until its request has come: from then on it is a
registered worker, counted by the registry (`max_workers`), not a call in flight. So
does a worker's stream of calls (Calls) until its first message: from then on it is
bound to its worker, one each (service/calls.py), and its messages take no slot.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import grpc

from tiercache_service.auth import Authenticator
from tiercache.deadlines import Deadlines
from tiercache.errors import DeadlineExceeded, ResourceExhausted, TiercacheError
from tiercache.wire import details_of, status_of

HEALTH_SERVICE = "/grpc.health.v1.Health/"
HEALTH_CALLS = 32
HEALTH_PER_PEER = 4
HEALTH_REQUEST_SECONDS = 2.0
_OPEN_METHODS = ("/grpc.reflection.",)  # reflection describes the API: anyone may ask


@dataclass(frozen=True)
class GateConfig:
    total: int  # cache calls in flight, the daemon over
    per_tenant: int  # cache calls in flight of one tenant
    request_seconds: float  # how long a call may take to send its request


class _Slots:
    """Counted slots under names, taken without waiting."""

    def __init__(self, total: int, per_name: int) -> None:
        self.total, self.per_name = total, per_name
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def take(self, name: str) -> bool:
        with self._lock:
            if sum(self._held.values()) >= self.total or self._held[name] >= self.per_name:
                return False
            self._held[name] += 1
            return True

    def give(self, name: str) -> None:
        with self._lock:
            self._held[name] -= 1
            if not self._held[name]:
                del self._held[name]


def _abort(context: grpc.ServicerContext, error: TiercacheError) -> None:
    context.abort(status_of(error), details_of(error))


class CallGate(grpc.ServerInterceptor):
    def __init__(self, auth: Authenticator, config: GateConfig) -> None:
        self.auth = auth
        self.config = config
        self._calls = _Slots(config.total, config.per_tenant)
        self._health = _Slots(HEALTH_CALLS, HEALTH_PER_PEER)
        self._watchdog = Deadlines("tiercache-watchdog", every=0.1)  # calls whose request is late

    def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        # once per method (observe.PerMethod): the work of each call is in the handler
        handler = continuation(details)
        if handler is None or details.method.startswith(_OPEN_METHODS):
            return handler
        health = details.method.startswith(HEALTH_SERVICE)
        for kind in ("unary_unary", "unary_stream", "stream_stream"):
            behaviour = getattr(handler, kind)
            if behaviour:
                make = (grpc.stream_unary_rpc_method_handler if kind == "unary_unary"
                        else grpc.stream_stream_rpc_method_handler)
                return make(self._gated(behaviour, health, kind), handler.request_deserializer,
                            handler.response_serializer)
        return handler  # the API has no client-streaming methods

    def _admit(self, context: grpc.ServicerContext, health: bool) -> tuple[_Slots, str]:
        """Take a slot for the call, or end it; the slots and the name it holds."""
        if health:
            slots, name = self._health, context.peer().rsplit(":", 1)[0]
            why = "health checks"
        else:
            slots, name = self._calls, self.auth.identify(context).tenant
            why = "calls"
        if not slots.take(name):
            raise ResourceExhausted(f"too many {why} in flight (at most {slots.per_name} of one "
                                    f"caller, {slots.total} in all): retry, or raise "
                                    "--max-concurrent-rpcs")
        return slots, name

    def _request(self, requests: Iterator[Any], context: grpc.ServicerContext,
                 health: bool) -> Any:
        """The call's request, within the time it has to send one; a call that ends without
        one (cancelled by the watchdog or its client, or sent something grpc could not
        parse, which grpc answered already) ends here."""
        seconds = HEALTH_REQUEST_SECONDS if health else self.config.request_seconds
        try:
            with self._watchdog.watching(context, seconds):
                return next(requests)
        except (StopIteration, grpc.RpcError):
            pass
        _abort(context, DeadlineExceeded("the call sent no request in time: nothing was done"))

    def _gated(self, behaviour: Callable, health: bool, kind: str) -> Callable:
        def enter(requests: Iterator[Any], context: grpc.ServicerContext) -> tuple[Any, Callable]:
            try:
                slots, name = self._admit(context, health)
            except TiercacheError as error:
                _abort(context, error)
            held = [True]

            def leave() -> None:
                if held[0]:
                    held[0] = False
                    slots.give(name)
            try:
                request = self._request(requests, context, health)
            except BaseException:
                leave()
                raise
            return request, leave

        def unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            request, leave = enter(requests, context)
            try:
                return behaviour(request, context)
            finally:
                leave()

        def stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            request, leave = enter(requests, context)
            if not health:
                leave()  # a registration: the registry counts it from now on
            try:
                yield from behaviour(request, context)
            finally:
                leave()

        def calls(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            request, leave = enter(requests, context)
            leave()  # bound to its worker from now on, one each (service/calls.py)
            yield from behaviour(itertools.chain((request,), requests), context)
        return {"unary_unary": unary, "unary_stream": stream, "stream_stream": calls}[kind]
