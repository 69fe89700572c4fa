"""A registered worker's Match, Load and Store calls as messages of one stream (the Calls
RPC), each answered with what a call of its own would have answered.

A unary call costs grpc-python a new HTTP/2 stream, its headers and trailers, and a
thread of the pool handed the call, both ways: on an H100 host a bare server's round trip
of a 48 KB request took 0.54 ms as a call and 0.26 ms as one message each way on an open
stream (benchmarks/RESULTS.md). A worker's stream carries its calls one at a time, in
order.

The stream is the worker's: its first message binds it to that message's worker_id, and
every later one must name the same worker. A worker has one: binding a newer one ends the
older (its client gave up on it after a call's timeout), and the registry ends it with the
registration. So open streams, each holding a thread, stay within --max-workers. A call
that fails is answered in its reply (its status code and details) and the stream goes on;
only a message that breaks these rules ends it.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Protocol

import grpc

from tiercache_service.errors import answer_of
from tiercache_service.logs import REQUEST_ID, REQUEST_ID_HEADER, request_id
from tiercache.errors import InvalidArgument
from tiercache.v1 import tiercache_pb2 as pb

# what each message's end is told: (method, status, seconds, request id, details)
Observe = Callable[[str, grpc.StatusCode, float, str, str], None]
METHODS = {"match": "Match", "load": "Load", "store": "Store"}


class Caller(Protocol):
    """What a message's call sees of who sent it: the stream's context, or a lane's caller
    (service/lanes.py)."""

    def invocation_metadata(self) -> Any: ...
    def auth_context(self) -> Any: ...
    def peer(self) -> str: ...
    def is_active(self) -> bool: ...


class MessageContext:
    """The stream's context as one message's call sees it: the stream's caller and
    liveness, the message's own deadline."""

    def __init__(self, stream: Caller, timeout: float) -> None:
        if math.isnan(timeout) or timeout < 0:
            raise InvalidArgument(f"timeout_seconds is {timeout}: give a positive number of "
                                  "seconds, or 0 for none")
        self._stream = stream
        self._deadline = time.monotonic() + timeout if 0 < timeout < math.inf else None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def is_active(self) -> bool:
        return self._stream.is_active()

    # who calls: the stream's caller (service/auth.py reads these); nothing else of the
    # stream's (aborting it, its trailers) is a message's to touch
    def invocation_metadata(self) -> Any:
        return self._stream.invocation_metadata()

    def auth_context(self) -> Any:
        return self._stream.auth_context()

    def peer(self) -> str:
        return self._stream.peer()


def answer(message: pb.CallRequest, kind: str, handle: Callable[[Any, Any], Any],
           stream: Caller, observe: Observe) -> pb.CallReply:
    """The reply to one message: `handle`'s answer to its request, or its error."""
    method = METHODS[kind]
    rid = request_id(((REQUEST_ID_HEADER, message.request_id),))
    token = REQUEST_ID.set(rid)
    start = time.perf_counter()
    code, details = grpc.StatusCode.OK, ""
    try:
        reply = pb.CallReply(request_id=rid, **{kind: handle(getattr(message, kind),
                                                             MessageContext(stream, message.timeout_seconds))})
    except Exception as error:  # noqa: BLE001 - answered as a call of its own is
        code, details = answer_of(error, method)
    finally:
        REQUEST_ID.reset(token)
    observe(method, code, time.perf_counter() - start, rid, details)
    if code != grpc.StatusCode.OK:
        return pb.CallReply(code=code.value[0], details=details, request_id=rid)
    return reply
