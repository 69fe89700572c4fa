"""The one place where the daemon turns domain errors into gRPC status codes (the table
itself is tiercache.wire.STATUS_CODES, shared with the client)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import grpc

from tiercache.errors import TiercacheError
from tiercache.wire import details_of, status_of

log = logging.getLogger("tiercache.service")


def answer_of(error: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and details a call that raised `error` is answered with: a domain
    error's own; anything else is logged (call it where the error is handled) and
    answered INTERNAL without internals. Also each message of a Calls stream
    (service/calls.py)."""
    if isinstance(error, TiercacheError):
        return status_of(error), details_of(error)
    log.exception("%s failed", method)
    return grpc.StatusCode.INTERNAL, f"{method} failed inside the daemon: see its log"


def _guard(behaviour: Callable, method: str, streaming: bool) -> Callable:
    def abort(error: Exception, context: grpc.ServicerContext) -> None:
        context.abort(*answer_of(error, method))

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
