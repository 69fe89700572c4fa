"""The client's side of a worker's stream of calls, against streams whose timing a test
controls (the daemon's side, and the two together, are in tests/service/test_calls.py)."""

from __future__ import annotations

import threading
import time

import pytest

from tiercache.call_stream import CallStream
from tiercache.errors import InvalidArgument
from tiercache.v1 import tiercache_pb2 as pb


class Replies:
    """A stream's replies, each after `delay` seconds, whether or not it was cancelled (a
    reply may come just as the client cancels)."""

    def __init__(self, delay: float, reply: pb.CallReply) -> None:
        self.delay, self.reply, self.cancelled = delay, reply, False

    def __next__(self) -> pb.CallReply:
        time.sleep(self.delay)
        return self.reply

    def cancel(self) -> None:
        self.cancelled = True


def opener(delay: float, reply: pb.CallReply = pb.CallReply(match=pb.MatchResponse())):
    opened: list[Replies] = []

    def open_stream(requests) -> Replies:
        opened.append(Replies(delay, reply))
        return opened[-1]
    return opened, open_stream


def test_a_stream_cancelled_for_its_timeout_as_the_reply_came_is_not_used_again():
    opened, open_stream = opener(0.3)
    stream = CallStream(open_stream)
    assert stream.send("match", pb.MatchRequest(), timeout=0.05) is not None  # came, late
    assert opened[0].cancelled
    opened[0].delay = 0
    stream.send("match", pb.MatchRequest(), timeout=5)
    assert len(opened) == 2 and not opened[1].cancelled  # a new stream for the next call


def test_a_call_that_comes_in_time_keeps_its_stream():
    opened, open_stream = opener(0.0)
    stream = CallStream(open_stream)
    for _ in range(3):
        stream.send("match", pb.MatchRequest(), timeout=5)
    time.sleep(0.15)  # the overdue thread has looked since
    assert len(opened) == 1 and not opened[0].cancelled


def test_a_failed_call_raises_its_error_and_the_stream_goes_on():
    opened, open_stream = opener(0.0, pb.CallReply(code=3, details="kv row 99 is out of range"))
    stream = CallStream(open_stream)
    with pytest.raises(InvalidArgument, match="out of range"):
        stream.send("load", pb.LoadRequest(), timeout=5)
    opened[0].reply = pb.CallReply(load=pb.LoadResponse())
    assert stream.send("load", pb.LoadRequest(), timeout=5) is not None and len(opened) == 1


def test_a_busy_or_closed_stream_leaves_the_call_to_go_on_its_own():
    opened, open_stream = opener(0.3)
    stream = CallStream(open_stream)
    first = threading.Thread(target=stream.send, args=("match", pb.MatchRequest(), 5))
    first.start()
    time.sleep(0.1)
    assert stream.send("match", pb.MatchRequest(), timeout=5) is None  # busy
    first.join()
    stream.close()
    assert opened[0].cancelled
    assert stream.send("match", pb.MatchRequest(), timeout=5) is None  # closed
