"""A worker's Match, Load and Store as messages of one stream (the Calls RPC), against a
real daemon process: the same answers as calls of their own, errors answered in the
reply, one stream per worker bound to its caller, ended with its registration."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest

from tests.reliability.test_attacks import tenants_file
from tests.service.daemon import metrics_url, running_daemon, scrape
from tests.service.worker_process import LAYOUT, prompt, rows_of, source_bytes
from tiercache.client import Client
from tiercache.errors import DeadlineExceeded, InvalidArgument
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

CODE = grpc.StatusCode


class Stream:
    """A raw Calls stream: put requests, take replies (or the stream's error)."""

    def __init__(self, stub: pb_grpc.TiercacheStub, metadata=()) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = stub.Calls(iter(self._requests.get, None), metadata=metadata)

    def ask(self, **call) -> pb.CallReply:
        self._requests.put(pb.CallRequest(**call))
        return next(self.replies)

    def close(self) -> None:
        self._requests.put(None)
        self.replies.cancel()


def keys_of(worker, tokens=None) -> bytes:
    return b"".join(worker.keys(prompt(0) if tokens is None else tokens))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("daemon")) as (address, process):
        worker = Client(address, lanes=False).register("test-model", LAYOUT)
        for name, data in source_bytes(7).items():
            rows_of(worker, name).copy_(data)
        worker.store(prompt(0), kv_rows=range(6), checkpoints={96: 0})
        yield address, process, worker, pb_grpc.TiercacheStub(grpc.insecure_channel(address))
        worker.close()


def loads_what_was_stored(who) -> None:
    """`who` matches and loads prompt 0, byte for byte what the module's worker stored."""
    assert who.match(prompt(0)).pages == 6
    assert who.load(prompt(0), kv_rows=range(10, 16), slot=1).match.pages == 6
    for name, data in source_bytes(7).items():
        got, stored = ((rows_of(who, name)[10:16], data[0:6]) if name.startswith("kv")
                       else (rows_of(who, name)[1], data[0]))
        assert (got == stored).all(), name


def test_streamed_calls_answer_as_calls_of_their_own(world):
    address, process, worker, _ = world
    unary = Client(address, streamed_calls=False, lanes=False).register("test-model", LAYOUT)
    try:
        for who in (worker, unary):
            loads_what_was_stored(who)
        stored = worker.store(prompt(1), kv_rows=range(6), checkpoints={96: 0})
        assert stored.stored == 7 and unary.match(prompt(1)).pages == 6
        assert unary._backend._ways == () and worker._backend._ways[0]._replies is not None
        # each message is counted as a call of its method
        text = scrape(metrics_url(process))
        for method in ("Match", "Load", "Store"):
            assert f'method="{method}"' in text, method
        assert 'tiercache_rpc_requests_total{code="OK",method="Calls"' not in text  # still open
    finally:
        unary.close()


def test_a_failed_call_is_answered_in_its_reply_and_the_stream_goes_on(world):
    _, _, _, stub = world
    worker = Client(world[0], lanes=False).register("test-model", LAYOUT)
    stream = Stream(stub)
    try:
        me = worker._backend._id
        bad = stream.ask(load=pb.LoadRequest(worker_id=me, keys=keys_of(worker), kv_rows=[1, 99], slot=1))
        assert bad.code == CODE.INVALID_ARGUMENT.value[0] and "99" in bad.details
        assert not bad.HasField("load") and bad.request_id
        late = stream.ask(match=pb.MatchRequest(worker_id=me, keys=keys_of(worker)), timeout_seconds=-1)
        assert late.code == CODE.INVALID_ARGUMENT.value[0] and "timeout_seconds" in late.details
        empty = stream.ask(match=pb.MatchRequest(worker_id=me, keys=b""))
        assert empty.code == CODE.INVALID_ARGUMENT.value[0]
        good = stream.ask(match=pb.MatchRequest(worker_id=me, keys=keys_of(worker)), request_id="mine-1")
        assert good.code == 0 and good.HasField("match") and good.request_id == "mine-1"
        # the client raises the same errors as for calls of their own
        with pytest.raises(InvalidArgument, match="out of range"):
            worker.load(prompt(0), kv_rows=[1, 99], slot=1)
        assert worker.match(prompt(0)).pages == 6
    finally:
        stream.close()
        worker.close()


@pytest.mark.parametrize("case", ["no call", "another worker", "unknown worker"])
def test_a_stream_carries_the_calls_of_one_registered_worker(world, case):
    _, _, worker, stub = world
    other = Client(world[0], lanes=False).register("test-model", LAYOUT)
    stream = Stream(stub)
    try:
        first = {"no call": {}, "another worker": {"match": pb.MatchRequest(
            worker_id=other._backend._id, keys=keys_of(worker))}, "unknown worker": {
            "match": pb.MatchRequest(worker_id="nobody", keys=keys_of(worker))}}[case]
        if case == "another worker":
            assert stream.ask(**first).code == 0  # bound to `other`
            first = {"match": pb.MatchRequest(worker_id=worker._backend._id, keys=keys_of(worker))}
        with pytest.raises(grpc.RpcError) as ended:
            stream.ask(**first)
        code = CODE.NOT_FOUND if case == "unknown worker" else CODE.INVALID_ARGUMENT
        assert ended.value.code() == code and ended.value.details()
    finally:
        stream.close()
        other.close()
    assert worker.match(prompt(0)).pages == 6  # the daemon still serves


def test_a_newer_stream_ends_the_older_and_the_registration_ends_its_stream(world):
    _, _, _, stub = world
    worker = Client(world[0], streamed_calls=False, lanes=False).register("test-model", LAYOUT)
    ask = {"match": pb.MatchRequest(worker_id=worker._backend._id, keys=keys_of(worker))}
    older, newer = Stream(stub), Stream(stub)
    try:
        assert older.ask(**ask).code == 0
        assert newer.ask(**ask).code == 0
        with pytest.raises(grpc.RpcError) as ended:
            older.ask(**ask)
        assert ended.value.code() == CODE.CANCELLED
        assert newer.ask(**ask).code == 0
        worker.close()  # ends the registration (the daemon sees it soon), and with it the stream
        deadline = time.monotonic() + 10
        with pytest.raises(grpc.RpcError) as ended:
            while time.monotonic() < deadline:  # until then, answered; after, NOT_FOUND
                assert newer.ask(**ask).code in (0, CODE.NOT_FOUND.value[0])
                time.sleep(0.05)
        assert ended.value.code() == CODE.CANCELLED
    finally:
        older.close()
        newer.close()


def test_streams_are_opened_by_their_workers_caller_only(tmp_path):
    tenants = tenants_file(tmp_path / "conf")
    with running_daemon(tmp_path / "data", "--tenants-file", tenants, "--request-seconds", "1") as (address, _):
        acme = Client(address, token="acme-token", lanes=False).register("test-model", LAYOUT)
        stub = pb_grpc.TiercacheStub(grpc.insecure_channel(address))
        ask = {"match": pb.MatchRequest(worker_id=acme._backend._id, keys=keys_of(acme))}
        for token, code in (("beta-token", CODE.PERMISSION_DENIED), ("no-such-token", CODE.UNAUTHENTICATED),
                            (None, CODE.PERMISSION_DENIED)):  # None: the socket's own tenant
            stream = Stream(stub, (("authorization", f"Bearer {token}"),) if token else ())
            with pytest.raises(grpc.RpcError) as refused:
                stream.ask(**ask)
            assert refused.value.code() == code, refused.value.details()
            stream.close()
        # a stream that sends nothing is ended once the time to send a request is up
        silent = stub.Calls(iter(queue.SimpleQueue().get, None),
                            metadata=(("authorization", "Bearer acme-token"),))
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as ended:
            next(silent)
        assert time.monotonic() - start < 5 and ended.value.code() in (CODE.DEADLINE_EXCEEDED,
                                                                       CODE.CANCELLED)
        assert acme.match(prompt(0)).pages == 0  # acme's own calls still go
        acme.close()


def test_a_call_past_its_timeout_raises_and_the_next_goes_on_a_new_stream(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERCACHE_FAILPOINTS", "load.before_reply=sleep(1.5)")
    with running_daemon(tmp_path) as (address, _):
        worker = Client(address, timeout=0.4, lanes=False).register("test-model", LAYOUT)
        worker.store(prompt(0), kv_rows=range(6), checkpoints={96: 0})
        first = worker._backend._ways[0]._replies
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            worker.load(prompt(0), kv_rows=range(10, 16), slot=1)
        assert time.monotonic() - start < 1.2  # not the daemon's 1.5 s
        time.sleep(1.5)  # the daemon's load finishes (its rows are not the worker's now)
        assert worker.match(prompt(0)).pages == 6
        assert worker._backend._ways[0]._replies is not first
        worker.close()


def matches_from_four_threads(worker) -> list[int]:
    """The pages of 50 Matches of prompt 0 from each of four threads at once."""
    answers: list[int] = []

    def match() -> None:
        for _ in range(50):
            answers.append(worker.match(prompt(0)).pages)
    threads = [threading.Thread(target=match) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def test_calls_from_two_threads_at_once_both_answer(world):
    assert matches_from_four_threads(world[2]) == [6] * 200


@pytest.mark.parametrize("lanes", [False, True])
def test_a_daemon_stopping_with_streams_or_lanes_open_ends_them_quietly(tmp_path, lanes):
    with running_daemon(tmp_path) as (address, process):
        worker = Client(address, lanes=lanes).register("test-model", LAYOUT)
        assert worker.match(prompt(0)).pages == 0  # its stream (or its lane) is open now
    said = process.stdout.read()
    assert process.returncode == 0, said
    assert "ERROR" not in said and "Traceback" not in said, said
    with pytest.raises(Exception):  # the daemon is gone: the worker's next call fails
        worker.match(prompt(0))
    worker.close()
