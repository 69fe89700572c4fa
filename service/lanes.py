"""A registered worker's lane (tiercache/lane.py), served by a thread of its own: each
request is answered as the same message on the worker's stream of calls would be
(service/calls.py), as the caller that opened the lane (the one that registered the
worker), and for that worker only.

A lane holds one call at a time, as a stream does, and its thread lives as long as the
registration: open lanes stay within --max-workers. Whatever a worker writes into its
lane, the thread answers it: bytes that are no CallRequest, a call for another worker or
none at all get INVALID_ARGUMENT, and nothing a call raises ends the thread.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError

from tiercache_service.errors import answer_of
from tiercache_service.workers import Registration
from tiercache import lane
from tiercache.errors import InvalidArgument
from tiercache.v1 import tiercache_pb2 as pb

log = logging.getLogger("tiercache.service")
_IDLE = 0.25  # seconds a lane's thread sleeps before it looks whether its registration ended


@dataclass(frozen=True)
class Opener:
    """Who opened the lane, as their OpenLane call showed them (the worker's registrant: the
    servicer checked): every call in the lane is answered as them (service/auth.py reads the
    first three), while the registration lasts."""

    metadata: tuple[Any, ...]
    auth: dict[str, list[bytes]]
    address: str
    registration: Registration

    @classmethod
    def of(cls, context: grpc.ServicerContext, registration: Registration) -> "Opener":
        return cls(tuple(context.invocation_metadata() or ()), dict(context.auth_context() or {}),
                   context.peer(), registration)

    def invocation_metadata(self) -> tuple[Any, ...]:
        return self.metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return self.auth

    def peer(self) -> str:
        return self.address

    def is_active(self) -> bool:
        return not self.registration.gone.is_set()


# the reply to one message of the lane, answered as `opener`
Answer = Callable[[pb.CallRequest, str, Opener], pb.CallReply]


def serve(mapping: ctypes.Array, opener: Opener, answer: Answer, stopping: threading.Event
          ) -> threading.Thread:
    """Start the thread that answers the calls in `mapping`, a lane of `opener`'s
    registration, until the registration ends or the daemon stops."""
    thread = threading.Thread(target=_serve, args=(mapping, opener, answer, stopping),
                              name=f"tiercache-lane-{opener.registration.id[:8]}", daemon=True)
    thread.start()
    return thread


def _serve(mapping: ctypes.Array, opener: Opener, answer: Answer, stopping: threading.Event) -> None:
    seen = 0
    while not (opener.registration.gone.is_set() or stopping.is_set()):
        seen, data = lane.next_request(mapping, seen, _IDLE)
        if data is not None:
            lane.reply(mapping, seen, _answered(data, opener, answer))


def _answered(data: bytes, opener: Opener, answer: Answer) -> bytes:
    """The serialised reply to one request's bytes, whatever they hold."""
    try:
        try:
            message = pb.CallRequest.FromString(data)
        except DecodeError:
            raise InvalidArgument("the lane holds no CallRequest: write one serialised message "
                                  "(tiercache/lane.py)") from None
        kind = message.WhichOneof("call")
        if kind is None:
            raise InvalidArgument("a CallRequest names no call: give match, load or store")
        if getattr(message, kind).worker_id != opener.registration.id:
            raise InvalidArgument(f"this lane carries worker {opener.registration.id!r}'s calls: "
                                  "use the lane of the worker you name")
        reply = answer(message, kind, opener)
    except Exception as error:  # noqa: BLE001 - answered, never the thread's end
        code, details = answer_of(error, "a lane's call")
        reply = pb.CallReply(code=code.value[0], details=details)
    data = reply.SerializeToString()
    if len(data) > lane.REPLY_BYTES:  # never so far: replies are a few bytes a page
        log.error("a reply of %d bytes does not fit a lane", len(data))
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
        data = pb.CallReply(code=code.value[0], details="the reply did not fit the lane: make the "
                            "call on the stream of calls").SerializeToString()
    return data
