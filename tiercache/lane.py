"""A worker's Match, Load and Store calls through shared memory of its own (its lane), for
a worker on the daemon's node: the same CallRequest and CallReply as the worker's stream
of calls (tiercache/call_stream.py), without gRPC's way in and out.

A message on a stream reaches the daemon's handler 0.3 ms after the worker sends it on
the 2-core machine, 0.65-0.85 ms on GPU hosts (benchmarks/RESULTS.md), most of it
grpc-python's transport and thread wake-ups. Through a lane, the worker writes the
request into the lane and publishes its number; the daemon's thread for that lane, asleep
on the number's word, wakes, answers, writes the reply and publishes the same number in
the reply's word, on which the worker sleeps (tiercache/_lane.c: a futex on a word both
processes map).

A lane is a sealed memfd (tiercache.shm) the worker creates once registered, hands over
like shared-memory buffers and opens by ticket (the OpenLane RPC). It is tied to that
registration: the daemon answers its calls as the caller that opened it (who must be the
one that registered), for that worker only. Its layout, in bytes:

    0       the request's number (uint32, written by the worker once the request is in)
    64      the request's length
    128     the reply's number (written by the daemon once the reply is in: the request's)
    192     the reply's length
    4096    the request, at most REQUEST_BYTES
    then    the reply, at most REPLY_BYTES

The worker's side follows CallStream's rules: one call at a time (a call made while
another thread's is in the lane answers None: make it another way), a call waits at most
its timeout, and a lane whose last reply has not come yet (its call timed out) takes no
call until it comes. A request too large for the lane answers None too.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from typing import Any, Callable

from tiercache import shm
from tiercache._lane import load, publish, wait
from tiercache.errors import DeadlineExceeded, InvalidArgument, Unavailable
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import error_from

REQUEST_NUMBER, REQUEST_LENGTH, REPLY_NUMBER, REPLY_LENGTH = 0, 64, 128, 192
HEADER = 4096
REQUEST_BYTES = 3 << 20
REPLY_BYTES = 1 << 20
LANE_BYTES = HEADER + REQUEST_BYTES + REPLY_BYTES
_REPLY_AT = HEADER + REQUEST_BYTES
_SLICE = 0.05  # seconds between a waiting worker's looks at whether the daemon is still there
# A worker spins this long for its reply before it sleeps, yielding its CPU to any thread
# that wants it (tiercache/_lane.c): a thread asleep wakes tens to
# hundreds of microseconds after it is woken, on a virtual machine's halted CPU. A 32k
# reload from the device tier took 1.03 ms spinning 2 ms, 1.16 ms spinning 50 us (H200,
# benchmarks/RESULTS.md).
_SPIN = 2e-3


class Lane:
    """The worker's side of a lane."""

    def __init__(self, alive: Callable[[], bool]) -> None:
        """A new lane, to a daemon that is there while `alive()`."""
        self._fd: int | None
        self._fd, self._mapping = shm.sealed(LANE_BYTES, "tiercache-lane")
        self._view = memoryview(self._mapping).cast("B")
        self._lock = threading.Lock()
        self._number = 0  # the last request's
        self._alive = alive
        self._closed = False

    def hand_over(self, path: str) -> bytes:
        """Pass the lane to the daemon at `path`; the ticket to open it by (OpenLane)."""
        assert self._fd is not None, "handed over already"
        try:
            return shm.hand_over(path, self._fd)
        finally:
            self._close_fd()

    def start(self, kind: str, request: Any, timeout: float) -> Callable[[], Any] | None:
        """Put `request` (CallRequest's field `kind`) in the lane; what waits at most
        `timeout` seconds for its reply (call it once, from any thread), or None when the
        lane is busy, closed or too small for it."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closed or load(self._mapping, REPLY_NUMBER) != self._number:  # a late reply to come
                self._lock.release()
                return None
            data = pb.CallRequest(timeout_seconds=timeout, **{kind: request}).SerializeToString()
            if len(data) > REQUEST_BYTES:
                self._lock.release()
                return None
            self._view[HEADER:HEADER + len(data)] = data
            struct.pack_into("<I", self._view, REQUEST_LENGTH, len(data))
            previous = self._number
            self._number = previous % 0xFFFFFFFF + 1  # never 0: a new lane's words are 0
            publish(self._mapping, REQUEST_NUMBER, self._number)  # after the bytes it numbers
        except BaseException:
            self._lock.release()
            raise
        return lambda: self._reply(kind, timeout, previous)

    def _reply(self, kind: str, timeout: float, previous: int) -> Any:
        try:
            reply = self._wait(timeout, previous)
        finally:
            self._lock.release()
        if reply.code:
            raise error_from(reply.code, reply.details)
        return getattr(reply, kind)

    def _wait(self, timeout: float, previous: int) -> pb.CallReply:
        """The reply, once the reply's word moves on from `previous` (the last reply's number)."""
        waited = 0.0
        while True:
            part = min(_SLICE, timeout - waited) if timeout > 0 else _SLICE
            if wait(self._mapping, REPLY_NUMBER, previous, part, _SPIN) != previous:
                break
            waited += part
            if not self._alive():
                self._closed = True
                raise Unavailable("the daemon went away with this worker's call in its lane "
                                  "(UNAVAILABLE): register again")
            if 0 < timeout <= waited:
                raise DeadlineExceeded(f"no reply within {timeout:g} s (DEADLINE_EXCEEDED)")
        (length,) = struct.unpack_from("<I", self._view, REPLY_LENGTH)
        if length > REPLY_BYTES:
            raise Unavailable(f"the daemon's reply says it is {length} bytes long, more than a "
                              "lane holds (UNAVAILABLE)")
        return pb.CallReply.FromString(bytes(self._view[_REPLY_AT:_REPLY_AT + length]))

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Take no more calls (a call in the lane still gets its reply)."""
        with self._lock:
            self._closed = True
            self._close_fd()


# -- the daemon's side ----------------------------------------------------------------------
def check(mapping: ctypes.Array) -> ctypes.Array:
    """A lane a worker handed over, if it is one (raises InvalidArgument otherwise)."""
    if len(mapping) != LANE_BYTES:
        raise InvalidArgument(f"a lane is {LANE_BYTES} bytes (tiercache/lane.py), this one "
                              f"{len(mapping)}: create it with tiercache.lane.Lane")
    return mapping


def next_request(mapping: ctypes.Array, seen: int, timeout: float) -> tuple[int, bytes | None]:
    """The next request in a lane whose last one was numbered `seen`: its number and its
    bytes, copied out (the worker may write the lane meanwhile), or (`seen`, None) after
    `timeout` seconds without one. A length past the lane's end gives empty bytes (a
    message that is not a call)."""
    number = wait(mapping, REQUEST_NUMBER, seen, timeout, 0.0)
    if number == seen:
        return seen, None
    view = memoryview(mapping).cast("B")
    (length,) = struct.unpack_from("<I", view, REQUEST_LENGTH)
    if length > REQUEST_BYTES:
        return number, b""
    return number, bytes(view[HEADER:HEADER + length])


def reply(mapping: ctypes.Array, number: int, data: bytes) -> None:
    """Answer request `number` with `data` (a serialised CallReply, at most REPLY_BYTES)."""
    assert len(data) <= REPLY_BYTES, "a lane's reply is at most REPLY_BYTES"
    view = memoryview(mapping).cast("B")
    view[_REPLY_AT:_REPLY_AT + len(data)] = data
    struct.pack_into("<I", view, REPLY_LENGTH, len(data))
    publish(mapping, REPLY_NUMBER, number)  # after the bytes it numbers
