"""A worker's Match, Load and Store through its lane (tiercache/lane.py, service/lanes.py),
against a real daemon process and real shared memory: the same answers as on the stream
of calls, whatever a worker writes into its lane answered without harm, calls answered as
the caller that registered, and a lane that ends with its registration."""

from __future__ import annotations

import os
import random
import signal
import struct
import threading
import time

import grpc
import pytest

import tiercache.lane as lane_module
from tests.polling import eventually
from tests.reliability.test_attacks import tenants_file
from tests.service.test_calls import loads_what_was_stored, matches_from_four_threads
from tests.service.daemon import daemon_in_this_process, metrics_url, running_daemon, scrape
from tests.service.worker_process import LAYOUT, prompt, rows_of, source_bytes
from tiercache.client import Client
from tiercache.errors import DeadlineExceeded, InvalidArgument, Unavailable
from tiercache.lane import HEADER, REQUEST_LENGTH, REQUEST_NUMBER, Lane, LANE_BYTES, publish
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

CODE = grpc.StatusCode


def lane_of(worker) -> Lane:
    way = worker._backend._ways[0]
    assert isinstance(way, Lane)
    return way


def raw(lane: Lane, data: bytes, length: int | None = None) -> pb.CallReply:
    """Write `data` into the lane as a worker could, whatever it is, and take the reply."""
    assert lane._lock.acquire(blocking=False)
    try:
        lane._view[HEADER:HEADER + len(data)] = data
        struct.pack_into("<I", lane._view, REQUEST_LENGTH, len(data) if length is None else length)
        previous = lane._number
        lane._number += 1
        publish(lane._mapping, REQUEST_NUMBER, lane._number)
        return lane._wait(10.0, previous)
    finally:
        lane._lock.release()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("daemon")) as (address, process):
        worker = Client(address).register("test-model", LAYOUT)
        for name, data in source_bytes(7).items():
            rows_of(worker, name).copy_(data)
        worker.store(prompt(0), kv_rows=range(6), checkpoints={96: 0})
        yield address, process, worker
        worker.close()


def test_calls_in_a_lane_answer_as_on_the_stream(world):
    address, process, worker = world
    streamed = Client(address, lanes=False).register("test-model", LAYOUT)
    lane = lane_of(worker)
    try:
        before = lane._number
        for who in (worker, streamed):
            loads_what_was_stored(who)
        stored = worker.store(prompt(1), kv_rows=range(6), checkpoints={96: 0})
        assert stored.stored == 7 and streamed.match(prompt(1)).pages == 6
        assert lane._number == before + 3  # the worker's three calls went in its lane
        assert not any(isinstance(way, Lane) for way in streamed._backend._ways)
        with pytest.raises(InvalidArgument, match="out of range"):  # errors as on the stream
            worker.load(prompt(0), kv_rows=[1, 99], slot=1)
        text = scrape(metrics_url(process))  # each call counted under its method
        for method in ("Match", "Load", "Store"):
            assert f'method="{method}"' in text, method
    finally:
        streamed.close()


def test_whatever_a_worker_writes_into_its_lane_is_answered_and_harms_nothing(world):
    address, _, worker = world
    other = Client(address).register("test-model", LAYOUT)
    lane, me = lane_of(worker), worker._backend._id
    keys = b"".join(worker.keys(prompt(0)))
    try:
        cases = {
            "not a message": (b"\xff" * 40, None),
            "a length past the lane": (b"", lane_module.REQUEST_BYTES + 1),
            "no call": (pb.CallRequest(timeout_seconds=5).SerializeToString(), None),
            "another worker": (pb.CallRequest(match=pb.MatchRequest(
                worker_id=other._backend._id, keys=keys)).SerializeToString(), None),
            "no such worker": (pb.CallRequest(match=pb.MatchRequest(
                worker_id="nobody", keys=keys)).SerializeToString(), None),
            "a negative timeout": (pb.CallRequest(match=pb.MatchRequest(worker_id=me, keys=keys),
                                                  timeout_seconds=-1).SerializeToString(), None),
            "rows out of range": (pb.CallRequest(load=pb.LoadRequest(
                worker_id=me, keys=keys, kv_rows=[1, 99], slot=1)).SerializeToString(), None),
        }
        for case, (data, length) in cases.items():
            reply = raw(lane, data, length)
            assert reply.code == CODE.INVALID_ARGUMENT.value[0] and reply.details, case
            assert reply.WhichOneof("reply") is None, case
        good = raw(lane, pb.CallRequest(match=pb.MatchRequest(worker_id=me, keys=keys),
                                        request_id="mine").SerializeToString())
        assert good.code == 0 and good.match.match.pages == 6 and good.request_id == "mine"
        # random damage to real requests: every one answered, none for another worker
        rng = random.Random(15)
        theirs = pb.CallRequest(load=pb.LoadRequest(worker_id=other._backend._id, keys=keys,
                                                    kv_rows=range(6), slot=0)).SerializeToString()
        for n in range(300):
            data = bytearray(rng.choice([theirs, good.SerializeToString(), bytes(cases["rows out of range"][0])]))
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data[:rng.randint(0, len(data))]) if rng.random() < 0.3 else bytes(data)
            reply = raw(lane, data)
            if reply.code == 0:
                assert reply.WhichOneof("reply") is not None, data
        assert worker.match(prompt(0)).pages == 6 and other.match(prompt(0)).pages == 6
    finally:
        other.close()


def test_calls_from_several_threads_at_once_all_answer(world):
    # one in the lane at a time, the others on the stream or as calls of their own
    assert matches_from_four_threads(world[2]) == [6] * 200


def test_a_lanes_calls_are_answered_as_the_caller_that_registered(tmp_path):
    tenants = tenants_file(tmp_path / "conf")
    with running_daemon(tmp_path / "data", "--tenants-file", tenants) as (address, _):
        acme = Client(address, token="acme-token").register("test-model", LAYOUT)
        beta = Client(address, token="beta-token").register("test-model", LAYOUT)
        try:
            for name, data in source_bytes(3).items():
                rows_of(acme, name).copy_(data)
            assert acme.store(prompt(0), kv_rows=range(6), checkpoints={96: 0}).stored == 7
            assert acme.match(prompt(0)).pages == 6  # its lane carries no token: the registration's
            assert beta.match(prompt(0)).pages == 0  # another tenant's namespace
            assert beta.load(prompt(0), kv_rows=range(6), slot=0).match.pages == 0
            # beta's lane naming acme's worker is refused, not answered as acme
            keys = b"".join(acme.keys(prompt(0)))
            reply = raw(lane_of(beta), pb.CallRequest(load=pb.LoadRequest(
                worker_id=acme._backend._id, keys=keys, kv_rows=range(6), slot=0)).SerializeToString())
            assert reply.code == CODE.INVALID_ARGUMENT.value[0] and not reply.HasField("load")
            assert lane_of(acme)._number == 2 and lane_of(beta)._number == 3
        finally:
            acme.close()
            beta.close()


def test_a_call_past_its_timeout_raises_and_the_lane_waits_for_its_late_reply(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERCACHE_FAILPOINTS", "load.before_reply=sleep(1.5)")
    with running_daemon(tmp_path) as (address, _):
        worker = Client(address, timeout=0.4).register("test-model", LAYOUT)
        lane = lane_of(worker)
        worker.store(prompt(0), kv_rows=range(6), checkpoints={96: 0})
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            worker.load(prompt(0), kv_rows=range(10, 16), slot=1)
        assert time.monotonic() - start < 1.2  # not the daemon's 1.5 s
        number = lane._number
        assert worker.match(prompt(0)).pages == 6  # on the stream: the lane's reply is due
        assert lane._number == number
        time.sleep(1.5)  # the late reply lands; the lane takes calls again
        assert worker.match(prompt(0)).pages == 6 and lane._number == number + 1
        worker.close()


def test_a_request_too_large_for_the_lane_goes_on_the_stream(world, monkeypatch):
    _, _, worker = world
    lane = lane_of(worker)
    number = lane._number
    monkeypatch.setattr(lane_module, "REQUEST_BYTES", 64)  # the worker's side only
    assert worker.match(prompt(0)).pages == 6
    assert lane._number == number


def test_a_worker_waiting_in_its_lane_learns_at_once_that_the_daemon_died(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERCACHE_FAILPOINTS", "load.before_reply=sleep(30)")
    with running_daemon(tmp_path) as (address, process):
        worker = Client(address, timeout=60).register("test-model", LAYOUT)
        worker.store(prompt(0), kv_rows=range(6), checkpoints={96: 0})
        threading.Timer(0.5, os.kill, (process.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(Unavailable):
            worker.load(prompt(0), kv_rows=range(10, 16), slot=1)
        assert time.monotonic() - start < 5  # not the call's 60 s
        worker.close()


def test_a_lanes_thread_ends_with_its_registration(tmp_path):
    def lanes() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("tiercache-lane-")]
    with daemon_in_this_process(tmp_path) as daemon:
        client = Client(daemon.addresses[0])
        before = len(lanes())
        worker = client.register("test-model", LAYOUT)
        assert len(lanes()) == before + 1 and worker.match(prompt(0)).pages == 0
        worker.close()
        assert eventually(lambda: len(lanes()) == before, 5)
        streamed = Client(daemon.addresses[0], lanes=False).register("test-model", LAYOUT)
        assert len(lanes()) == before  # no lane, no thread
        streamed.close()
        client.close()


def test_open_lane_refuses_what_is_not_a_lane_of_the_callers_worker_and_spends_the_ticket(tmp_path):
    tenants = tenants_file(tmp_path / "conf")
    with running_daemon(tmp_path / "data", "--tenants-file", tenants) as (address, _):
        acme = Client(address, token="acme-token", lanes=False).register("test-model", LAYOUT)
        path = address.removeprefix("unix:") + ".fds"
        stub = pb_grpc.TiercacheStub(grpc.insecure_channel(address))
        as_acme = (("authorization", "Bearer acme-token"),)

        def open_lane(size: int, worker_id: str, metadata=as_acme) -> grpc.StatusCode:
            fd, _ = lane_module.shm.sealed(size, "a-lane")
            ticket = lane_module.shm.hand_over(path, fd)
            os.close(fd)
            try:
                stub.OpenLane(pb.OpenLaneRequest(worker_id=worker_id, lane=pb.SharedMemoryBuffer(
                    ticket=ticket)), metadata=metadata)
                return CODE.OK
            except grpc.RpcError as error:
                return error.code()
        me = acme._backend._id
        # ten refusals in a row: each spends its ticket (a process may leave at most 8 waiting)
        for _ in range(5):
            assert open_lane(LANE_BYTES - 4096, me) == CODE.INVALID_ARGUMENT  # not a lane's size
            assert open_lane(LANE_BYTES, "nobody") == CODE.NOT_FOUND
        assert open_lane(LANE_BYTES, me, (("authorization", "Bearer beta-token"),)) == CODE.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as unknown:
            stub.OpenLane(pb.OpenLaneRequest(worker_id=me, lane=pb.SharedMemoryBuffer(ticket=b"x" * 16)),
                          metadata=as_acme)
        assert unknown.value.code() == CODE.NOT_FOUND
        assert open_lane(LANE_BYTES, me) == CODE.OK
        assert open_lane(LANE_BYTES, me) == CODE.FAILED_PRECONDITION  # one lane per registration
        acme.close()
