"""Every call, watched in one place: its request id is set for the log lines it causes
and sent back in the trailing metadata, and when it ends its status code and duration
go to the metrics and one log line. A stream whose client went away (a worker leaving
its Register stream) is a disconnect, logged and counted as one, not a CANCELLED call. It sits outside service.errors' interceptor, so
it sees the status the client gets."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator

import grpc

from tiercache_service.logs import REQUEST_ID, REQUEST_ID_HEADER, request_id
from tiercache_service.metrics import CallMetrics

log = logging.getLogger("tiercache.calls")


class ObservingInterceptor(grpc.ServerInterceptor):
    def __init__(self, metrics: CallMetrics) -> None:
        self.metrics = metrics

    def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        handler = continuation(details)
        if handler is None:  # an unknown method: grpc answers UNIMPLEMENTED, nothing to watch
            return None
        service, _, method = details.method.lstrip("/").rpartition("/")
        call = _Method(self.metrics, service, method)
        for kind in ("unary_unary", "stream_unary"):
            if getattr(handler, kind):
                return handler._replace(**{kind: call.wrap_unary(getattr(handler, kind))})
        for kind in ("unary_stream", "stream_stream"):
            if getattr(handler, kind):
                return handler._replace(**{kind: call.wrap_stream(getattr(handler, kind))})
        return handler


class PerMethod(grpc.ServerInterceptor):
    """The handler the interceptors after it make of a method, kept: they build the same
    one for every call of a method (building it per call took ~20 us a call on the 2-core
    machine, of the ~60 us the interceptors cost), so each does its per-call work inside
    the handler it returns, never in intercept_service. Unknown methods are not kept (any
    name may come)."""

    def __init__(self) -> None:
        self._handlers: dict[str, Any] = {}

    def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        handler = self._handlers.get(details.method)
        if handler is None:
            handler = continuation(details)
            if handler is not None:
                self._handlers[details.method] = handler
        return handler


class _Method:
    """One method's calls, watched: what is per call (its request id, its clock) is
    taken inside the handler, which is built once per method (PerMethod)."""

    def __init__(self, metrics: CallMetrics, service: str, method: str) -> None:
        self.metrics = metrics
        self.service = service
        self.method = method

    def wrap_unary(self, behaviour: Callable) -> Callable:
        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            rid = request_id(context.invocation_metadata())
            start, error = self._begin(context, rid), None
            token = REQUEST_ID.set(rid)
            try:
                return behaviour(request, context)
            except BaseException as raised:
                error = raised
                raise
            finally:
                self._end(context, rid, start, error, unary=True)
                REQUEST_ID.reset(token)
        return unary

    def wrap_stream(self, behaviour: Callable) -> Callable:
        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            rid = request_id(context.invocation_metadata())
            start, error = self._begin(context, rid), None
            responses = iter(behaviour(request, context))
            try:
                while True:
                    # the id is set only while the servicer's code runs: a stream's
                    # generator may be closed from another thread
                    token = REQUEST_ID.set(rid)
                    try:
                        response = next(responses)
                    except StopIteration:
                        return
                    finally:
                        REQUEST_ID.reset(token)
                    yield response
            except BaseException as raised:  # GeneratorExit too: the client left
                error = raised
                raise
            finally:
                close = getattr(responses, "close", None)
                if close is not None:
                    close()
                self._end(context, rid, start, error, unary=False)
        return stream

    @staticmethod
    def _begin(context: grpc.ServicerContext, rid: str) -> float:
        context.set_trailing_metadata(((REQUEST_ID_HEADER, rid),))
        return time.perf_counter()

    def _end(self, context: grpc.ServicerContext, rid: str, start: float,
             error: BaseException | None, unary: bool) -> None:
        seconds = time.perf_counter() - start
        if not unary and _left(context, error):
            # a worker that goes away ends its Register stream so: a normal end, no failure
            self.metrics.disconnected(self.service, self.method)
            log.info("%s stream ended: its client disconnected after %.1f s", self.method, seconds,
                     extra={"data": {"service": self.service, "method": self.method,
                                     "disconnected": True, "seconds": round(seconds, 3),
                                     "request_id": rid}})
            return
        code = _status(context, error)
        record(self.metrics, self.service, self.method, code, seconds, rid, unary,
               lambda: context.details())


def record(metrics: CallMetrics, service: str, method: str, code: grpc.StatusCode, seconds: float,
           rid: str, unary: bool = True, details: Callable[[], Any] = lambda: None) -> None:
    """A call's end in the metrics and the log (a line at DEBUG if it succeeded); also each
    message of a Calls stream, under the method it stands for (service/calls.py)."""
    metrics.observe(service, method, code.name, seconds, unary)
    level = logging.DEBUG if code == grpc.StatusCode.OK else logging.INFO
    if log.isEnabledFor(level):
        said = details() if code != grpc.StatusCode.OK else None
        log.log(level, "%s %s in %.3f ms", method, code.name, seconds * 1e3, extra={"data": {
            "service": service, "method": method, "code": code.name,
            "ms": round(seconds * 1e3, 3), "request_id": rid,
            **({"details": _text(said)} if said else {})}})


def _left(context: grpc.ServicerContext, error: BaseException | None) -> bool:
    """Whether the client ended the call by going away (no status was set: the server
    neither failed nor finished it)."""
    return context.code() is None and (isinstance(error, GeneratorExit) or not context.is_active())


def _status(context: grpc.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    """The status the call ends with: the one it set or aborted with; else OK, or
    CANCELLED for a stream its client left, or UNKNOWN for an uncaught exception
    (what grpc answers then)."""
    code = context.code()
    if code is not None:
        return code
    if isinstance(error, GeneratorExit) or not context.is_active():
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN


def _text(details: Any) -> str:
    return details.decode(errors="replace") if isinstance(details, bytes) else str(details)
