"""Every RPC given bad input answers the right status and leaves the cache as it was."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from tests.service.daemon import running_daemon
from tests.service.worker_process import LAYOUT, prompt
from tiercache.client import Client
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc
from tiercache.wire import layout_to_proto, status_from

CODE = grpc.StatusCode


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A daemon with small limits, one registered worker and one stored prompt."""
    folder = tmp_path_factory.mktemp("daemon")
    with running_daemon(folder, "--max-message-bytes", "1MiB", "--max-prompt-pages", "1000") as (address, _):
        # its calls each on their own: the streamed cases bind a stream of their own to it
        client = Client(address, streamed_calls=False)
        worker = client.register("test-model", LAYOUT)
        worker.store(prompt(0), kv_rows=range(6), checkpoints={96: 0})
        stub = pb_grpc.TiercacheStub(grpc.insecure_channel(address))
        yield client, worker, stub
        worker.close()


def snapshot(client):
    stats = client.stats()
    return stats.tiers, stats.counters


def keys_of(worker, tokens=None):
    return b"".join(worker.keys(prompt(0) if tokens is None else tokens))


CASES = {
    "match, unknown worker": (CODE.NOT_FOUND, lambda s, w: s.Match(
        pb.MatchRequest(worker_id="nobody", keys=keys_of(w)))),
    "load, row out of range": (CODE.INVALID_ARGUMENT, lambda s, w: s.Load(
        pb.LoadRequest(worker_id=w._backend._id, keys=keys_of(w), kv_rows=[1, 2, 64], slot=1))),
    "load, packed row out of range": (CODE.INVALID_ARGUMENT, lambda s, w: s.Load(
        pb.LoadRequest(worker_id=w._backend._id, keys=keys_of(w), slot=1,
                       kv_rows_packed=np.array([1, 2, 64], "<u4").tobytes()))),
    "load, packed rows not 4 bytes each": (CODE.INVALID_ARGUMENT, lambda s, w: s.Load(
        pb.LoadRequest(worker_id=w._backend._id, keys=keys_of(w), kv_rows_packed=b"\1\0\0", slot=1))),
    "load, rows given twice": (CODE.INVALID_ARGUMENT, lambda s, w: s.Load(
        pb.LoadRequest(worker_id=w._backend._id, keys=keys_of(w), kv_rows=[1], slot=1,
                       kv_rows_packed=np.array([1], "<u4").tobytes()))),
    "load, a done event from a CPU worker": (CODE.INVALID_ARGUMENT, lambda s, w: s.Load(
        pb.LoadRequest(worker_id=w._backend._id, keys=keys_of(w), kv_rows=[1, 2], slot=1,
                       done_event=b"\1" * 64))),
    "store, a done event from a CPU worker": (CODE.INVALID_ARGUMENT, lambda s, w: s.Store(
        pb.StoreRequest(worker_id=w._backend._id, keys=keys_of(w, list(range(96))),
                        kv_rows=range(6), done_event=b"\1" * 64))),
    "load, a signal from a worker that registered none": (CODE.INVALID_ARGUMENT, lambda s, w: s.Load(
        pb.LoadRequest(worker_id=w._backend._id, keys=keys_of(w), kv_rows=[1, 2], slot=1,
                       signal=pb.Signal(slot=0, value=1)))),
    "store, a signal from a worker that registered none": (CODE.INVALID_ARGUMENT, lambda s, w: s.Store(
        pb.StoreRequest(worker_id=w._backend._id, keys=keys_of(w, list(range(96))),
                        kv_rows=range(6), signal=pb.Signal(slot=3, value=7)))),
    "settle, a worker that registered no signals": (CODE.INVALID_ARGUMENT, lambda s, w: s.Settle(
        pb.SettleRequest(worker_id=w._backend._id, signal=pb.Signal(slot=0, value=1)))),
    "settle, no signal": (CODE.INVALID_ARGUMENT, lambda s, w: s.Settle(
        pb.SettleRequest(worker_id=w._backend._id))),
    "settle, unknown worker": (CODE.NOT_FOUND, lambda s, w: s.Settle(
        pb.SettleRequest(worker_id="nobody", signal=pb.Signal(slot=0, value=1)))),
    "load, slot out of range": (CODE.INVALID_ARGUMENT, lambda s, w: s.Load(
        pb.LoadRequest(worker_id=w._backend._id, keys=keys_of(w), kv_rows=[1, 2], slot=16))),
    "store, row out of range": (CODE.INVALID_ARGUMENT, lambda s, w: s.Store(
        pb.StoreRequest(worker_id=w._backend._id, keys=keys_of(w, list(range(96))),
                        kv_rows=[0, 1, 2, 3, 4, 99]))),
    "store, packed row out of range": (CODE.INVALID_ARGUMENT, lambda s, w: s.Store(
        pb.StoreRequest(worker_id=w._backend._id, keys=keys_of(w, list(range(96))),
                        kv_rows_packed=np.array([0, 1, 2, 3, 4, 99], "<u4").tobytes()))),
    "store, checkpoint past the prompt": (CODE.INVALID_ARGUMENT, lambda s, w: s.Store(
        pb.StoreRequest(worker_id=w._backend._id, keys=keys_of(w, list(range(96))),
                        kv_rows=range(6), checkpoints=[pb.Checkpoint(pages=7, slot=0)]))),
    "store, two checkpoints at one page": (CODE.INVALID_ARGUMENT, lambda s, w: s.Store(
        pb.StoreRequest(worker_id=w._backend._id, keys=keys_of(w, list(range(96))), kv_rows=range(6),
                        checkpoints=[pb.Checkpoint(pages=6, slot=0), pb.Checkpoint(pages=6, slot=1)]))),
    "register, wrong layout": (CODE.INVALID_ARGUMENT, lambda s, w: next(s.Register(
        pb.RegisterRequest(model_id="m", layout=pb.Layout(page_tokens=0, paged=[
            pb.BufferSpec(name="k", rows=4, row_shape=[8], dtype="bfloat16")]))))),
    "register, buffers that do not match the layout": (CODE.INVALID_ARGUMENT, lambda s, w: next(
        s.Register(pb.RegisterRequest(model_id="m", layout=layout_to_proto(LAYOUT), buffers=[
            pb.BufferLocation(name="kv0", nbytes=12, shm=pb.SharedMemoryBuffer(ticket=b"x"))])))),
    "register, missing shared memory": (CODE.NOT_FOUND, lambda s, w: next(s.Register(
        pb.RegisterRequest(model_id="m", layout=layout_to_proto(LAYOUT), buffers=[
            pb.BufferLocation(name=b.name, nbytes=b.rows * b.row_bytes,
                              shm=pb.SharedMemoryBuffer(ticket=b"\0" * 16))
            for b in (*LAYOUT.paged, *LAYOUT.slots)])))),
    "oversized request": (CODE.RESOURCE_EXHAUSTED, lambda s, w: s.Match(
        pb.MatchRequest(worker_id=w._backend._id, keys=b"\1" * (2 << 20)))),
    "too many pages": (CODE.INVALID_ARGUMENT, lambda s, w: s.Match(
        pb.MatchRequest(worker_id=w._backend._id, keys=b"\1" * 16 * 1001))),
    "empty prompt": (CODE.INVALID_ARGUMENT, lambda s, w: s.Match(
        pb.MatchRequest(worker_id=w._backend._id, keys=b""))),
    "keys cut short": (CODE.INVALID_ARGUMENT, lambda s, w: s.Load(
        pb.LoadRequest(worker_id=w._backend._id, keys=keys_of(w)[:-3], kv_rows=[1], slot=1))),
    "evict, unknown tier": (CODE.INVALID_ARGUMENT, lambda s, w: s.Evict(
        pb.EvictRequest(worker_id=w._backend._id, keys=keys_of(w), tier=3))),
    "unregister, unknown worker": (CODE.NOT_FOUND, lambda s, w: s.Unregister(
        pb.UnregisterRequest(worker_id="nobody"))),
}


class _Failed(grpc.RpcError):
    def __init__(self, reply: pb.CallReply) -> None:
        self._reply = reply

    def code(self) -> grpc.StatusCode:
        return status_from(self._reply.code)

    def details(self) -> str:
        return self._reply.details


class Streamed:
    """The stub, its Match, Load and Store sent as the message of a Calls stream."""

    def __init__(self, stub: pb_grpc.TiercacheStub) -> None:
        self._stub = stub

    def __getattr__(self, name: str):
        kind = {"Match": "match", "Load": "load", "Store": "store"}.get(name)
        if kind is None:
            return getattr(self._stub, name)

        def call(request):
            reply = next(self._stub.Calls(iter([pb.CallRequest(**{kind: request})])))
            if reply.code:
                raise _Failed(reply)
            return getattr(reply, kind)
        return call


@pytest.mark.parametrize("streamed", [False, True], ids=["call", "streamed"])
@pytest.mark.parametrize("case", CASES)
def test_bad_input_gets_its_status_and_changes_nothing(world, case, streamed):
    client, worker, stub = world
    code, call = CASES[case]
    before = snapshot(client)
    with pytest.raises(grpc.RpcError) as failure:
        call(Streamed(stub) if streamed else stub, worker)
    assert failure.value.code() == code, failure.value.details()
    assert failure.value.details()  # always a message that says what was wrong
    assert snapshot(client) == before
    assert worker.match(prompt(0)).pages == 6  # and the daemon still serves


def test_the_client_raises_the_same_errors_as_the_engine(world):
    from tiercache.errors import InvalidArgument
    client, worker, _ = world
    with pytest.raises(InvalidArgument, match="out of range"):
        worker.load(prompt(0), kv_rows=[70], slot=0)
    with pytest.raises(InvalidArgument, match="multiple of the page size"):
        worker.store(prompt(0), kv_rows=range(6), checkpoints={50: 0})
    with pytest.raises(InvalidArgument, match="kv row -1 is out of range"):
        worker.load(prompt(0), kv_rows=[3, -1], slot=0)  # caught before it is sent
    with pytest.raises(InvalidArgument, match="flat list of integers"):
        worker.load(prompt(0), kv_rows=[0.5, 1.5], slot=0)


def test_rows_sent_unpacked_load_as_packed_ones_do(world):
    # kv_rows is the field older daemons read and clients in other languages fill; the
    # Python client packs rows for a daemon that says it reads them so
    client, worker, stub = world
    assert worker._backend._packed
    packed = worker.load(prompt(0), kv_rows=np.arange(10, 16), slot=1)
    reply = stub.Load(pb.LoadRequest(worker_id=worker._backend._id, keys=keys_of(worker),
                                     kv_rows=list(range(10, 16)), slot=1))
    assert packed.match.pages == reply.match.pages == 6
    sent, real = [], worker._backend._sent
    worker._backend._sent = lambda kind, request, *rest: sent.append(request) or real(kind, request, *rest)
    worker._backend._packed = False  # as after registering with an older daemon
    try:
        assert worker.load(prompt(0), kv_rows=range(10, 16), slot=1).match.pages == 6
        worker._backend._packed = True
        assert worker.load(prompt(0), kv_rows=range(10, 16), slot=1).match.pages == 6
    finally:
        worker._backend._packed = True
        del worker._backend._sent
    assert (list(sent[0].kv_rows), sent[0].kv_rows_packed) == (list(range(10, 16)), b"")
    assert (list(sent[1].kv_rows), sent[1].kv_rows_packed) == ([], np.arange(10, 16, dtype="<u4").tobytes())
