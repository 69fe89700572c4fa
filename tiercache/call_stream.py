"""A worker's Match, Load and Store calls over one open stream to its daemon (the Calls
RPC, service/calls.py): the same requests and replies as calls of their own, without a
call's setup and teardown each time (a Match of a 32k-token prompt 0.16-0.18 ms sooner on
the 2-core machine, benchmarks/RESULTS.md).

One call at a time goes on the stream. A call made while another thread's is on it goes
as a call of its own (`send` answers None). A call waits for its reply at most its
timeout: one thread of the process cancels the stream of a call past it (checking every
50 ms), the call raises DeadlineExceeded, and the next call opens a new stream (the
daemon then ends the old one's binding). A call whose stream broke raises what broke it,
as a call of its own would; the next one opens a new stream.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

import grpc

from tiercache.deadlines import Deadlines
from tiercache.errors import DeadlineExceeded, Unavailable
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import error_from, error_of

_END = None  # ends a stream's requests
_OVERDUE = Deadlines("tiercache-overdue", every=0.05)  # cancels the streams of calls past their timeout


class CallStream:
    """One worker's stream of calls, opened at its first call by `open_stream`."""

    def __init__(self, open_stream: Callable[[Iterator[pb.CallRequest]], Any]) -> None:
        self._open = open_stream
        self._lock = threading.Lock()
        # the stream's requests, which grpc reads from a thread of its own until _END
        self._requests: queue.SimpleQueue[pb.CallRequest | None] | None = None
        self._replies: Any = None  # grpc's iterator of replies, also the call to cancel
        self._closed = False

    def send(self, kind: str, request: Any, timeout: float) -> Any | None:
        """The reply to `request` (CallRequest's field `kind`), waited for at most
        `timeout` seconds; None when the stream is busy with another thread's call or
        closed (make it a call of its own then). A failed call raises its error."""
        reply = self.start(kind, request, timeout)
        return None if reply is None else reply()

    def start(self, kind: str, request: Any, timeout: float) -> Callable[[], Any] | None:
        """`send` in two halves: puts `request` on the stream now and returns what waits
        for its reply (call it once, from any thread: the stream carries no other call
        until then); None when the stream is busy or closed."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closed:
                self._lock.release()
                return None
            if self._replies is None:
                self._requests = queue.SimpleQueue()
                self._replies = self._open(iter(self._requests.get, _END))
            self._requests.put(pb.CallRequest(timeout_seconds=timeout, **{kind: request}))
        except BaseException:
            self._lock.release()
            raise
        return lambda: self._reply(kind, timeout)

    def _reply(self, kind: str, timeout: float) -> Any:
        try:
            with _OVERDUE.watching(self._replies, timeout) as overdue:
                try:
                    reply = next(self._replies)
                except (grpc.RpcError, StopIteration) as error:
                    self._end()
                    if overdue:
                        raise DeadlineExceeded(f"no reply within {timeout:g} s (DEADLINE_EXCEEDED)") from None
                    if isinstance(error, grpc.RpcError):
                        raise error_of(error) from None
                    raise Unavailable("the daemon ended this worker's stream of calls (UNAVAILABLE)") from None
            if overdue:  # cancelled as its reply came: the next call opens a new stream
                self._end()
        finally:
            self._lock.release()
        if reply.code:
            raise error_from(reply.code, reply.details)
        return getattr(reply, kind)

    def _end(self) -> None:
        if self._requests is not None:
            self._requests.put(_END)
        if self._replies is not None:
            self._replies.cancel()
        self._requests = self._replies = None

    def close(self) -> None:
        """End the stream; later calls go as calls of their own."""
        with self._lock:
            self._closed = True
            self._end()
