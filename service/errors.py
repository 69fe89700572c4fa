"""The one place where the daemon turns domain errors into gRPC status codes (the table
itself is tiercache.wire.STATUS_CODES, shared with the client)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import grpc

from tiercache.errors import TiercacheError
from tiercache.wire import details_of, status_of

log = logging.getLogger("tiercache.service")


def _guard(behaviour: Callable, method: str, streaming: bool) -> Callable:
    def abort(error: Exception, context: grpc.ServicerContext) -> None:
        if isinstance(error, TiercacheError):
            context.abort(status_of(error), details_of(error))
        log.exception("%s failed", method)
        context.abort(grpc.StatusCode.INTERNAL, f"{method} failed inside the daemon: see its log")

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behaviour(request, context)
        except Exception as error:  # noqa: BLE001 - mapped to a status, never a crash
            abort(error, context)

    def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behaviour(request, context)
        except Exception as error:  # noqa: BLE001
            abort(error, context)
    return stream if streaming else unary


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps TiercacheError subclasses to their status code with the error's own message;
    anything else is logged and answered INTERNAL without internals."""

    def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        # once per method (observe.PerMethod): the work of each call is in the handler
        handler = continuation(details)
        if handler is None:
            return None
        if handler.unary_unary:
            return handler._replace(unary_unary=_guard(handler.unary_unary, details.method, False))
        for kind in ("unary_stream", "stream_stream"):
            if getattr(handler, kind):
                return handler._replace(**{kind: _guard(getattr(handler, kind), details.method, True)})
        return handler
