"""The servicer in-process, with a real engine and real shared memory, for what a real
socket cannot stage reliably (a deadline already past on arrival)."""

from __future__ import annotations

import threading

import grpc
import pytest

from tiercache_service.errors import ErrorInterceptor
from tiercache_service.servicer import TiercacheServicer
from tiercache_service.workers import WorkerRegistry
from tests.service.worker_process import LAYOUT, prompt
from tiercache.engine import Engine, EngineConfig
from tiercache.hashing import key_array, page_keys
from drills.context import Aborted, Context
from tiercache_service.handover import Handover
from tiercache.shm import SharedBuffers
from tiercache.tiers.host import HostConfig
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import layout_to_proto


@pytest.fixture
def served(tmp_path):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 24)))
    handover = Handover(str(tmp_path / "fds")).start()  # the real handover, on a real socket
    servicer = TiercacheServicer(engine, WorkerRegistry(4, engine.quiesce, tickets=handover),
                                 max_prompt_pages=1000)
    shared = SharedBuffers.create(LAYOUT)
    ticket = shared.hand_over(handover.path)
    request = pb.RegisterRequest(model_id="test-model", layout=layout_to_proto(LAYOUT), buffers=[
        pb.BufferLocation(name=p.spec.name, nbytes=p.nbytes,
                          shm=pb.SharedMemoryBuffer(ticket=ticket, offset=p.offset))
        for p in shared.placements])
    stream = servicer.Register(request, Context())
    reply = next(stream)
    yield servicer, reply, engine
    servicer.registry.remove_all()
    handover.stop()
    shared.close()
    engine.close()


def guarded(servicer, method):
    """The servicer's method behind the daemon's error interceptor."""
    handler = grpc.unary_unary_rpc_method_handler(getattr(servicer, method))

    class Details:
        pass
    details = Details()
    details.method = f"/tiercache.v1.Tiercache/{method}"
    return ErrorInterceptor().intercept_service(lambda _: handler, details).unary_unary


def test_a_deadline_already_past_is_refused_before_any_work(served):
    servicer, reply, engine = served
    keys = b"".join(page_keys(prompt(0), reply.namespace_root, 16))
    context = Context(remaining=0.0)
    with pytest.raises(Aborted, match="deadline"):
        guarded(servicer, "Store")(pb.StoreRequest(worker_id=reply.worker_id, keys=keys,
                                                   kv_rows=range(6)), context)
    assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(engine.index) == 0


def test_the_servicer_stores_and_matches_in_process(served):
    servicer, reply, engine = served
    keys = b"".join(page_keys(prompt(0), reply.namespace_root, 16))
    stored = servicer.Store(pb.StoreRequest(worker_id=reply.worker_id, keys=keys, kv_rows=range(6),
                                            checkpoints=[pb.Checkpoint(pages=6, slot=2)]), Context())
    assert (stored.stored, list(stored.checkpoints)) == (7, [6])
    match = servicer.Match(pb.MatchRequest(worker_id=reply.worker_id, keys=keys), Context()).match
    assert (match.pages, match.tokens, match.stop) == (6, 96, pb.END_OF_PROMPT)
    assert match.page_tiers == bytes([pb.TIER_HOST]) * 6 and match.checkpoint_tier == pb.TIER_HOST
    assert len(key_array(keys)) == 6


def test_an_unexpected_error_is_internal_without_internals(served, monkeypatch):
    servicer, reply, engine = served
    monkeypatch.setattr(engine, "match", lambda *a: 1 / 0)
    context = Context()
    keys = b"".join(page_keys(prompt(0), reply.namespace_root, 16))
    with pytest.raises(Aborted):
        guarded(servicer, "Match")(pb.MatchRequest(worker_id=reply.worker_id, keys=keys), context)
    assert context.code == grpc.StatusCode.INTERNAL and "ZeroDivision" not in context.details


def test_a_registration_that_ends_waits_for_its_copies_without_holding_up_other_calls(tmp_path):
    # ending a registration waits until no copy touches its buffers, which may take
    # seconds of a worker's GPU work: meanwhile every other call goes on
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 24)))
    handover = Handover(str(tmp_path / "fds")).start()
    copying, done = threading.Event(), threading.Event()

    def quiesce(buffers):  # the engine's, after copies that take until the test says
        copying.set()
        assert done.wait(10)
        engine.quiesce(buffers)
    servicer = TiercacheServicer(engine, WorkerRegistry(4, quiesce, tickets=handover),
                                 max_prompt_pages=1000)
    workers, shared = [], []
    for _ in range(2):
        shared.append(SharedBuffers.create(LAYOUT))
        ticket = shared[-1].hand_over(handover.path)
        workers.append(next(servicer.Register(pb.RegisterRequest(
            model_id="test-model", layout=layout_to_proto(LAYOUT), buffers=[
                pb.BufferLocation(name=p.spec.name, nbytes=p.nbytes,
                                  shm=pb.SharedMemoryBuffer(ticket=ticket, offset=p.offset))
                for p in shared[-1].placements]), Context())))
    ending = threading.Thread(target=servicer.registry.remove, args=(workers[0].worker_id,))
    ending.start()
    assert copying.wait(10)
    keys = b"".join(page_keys(prompt(0), workers[1].namespace_root, 16))
    stored = servicer.Store(pb.StoreRequest(worker_id=workers[1].worker_id, keys=keys,
                                            kv_rows=range(6), checkpoints=[pb.Checkpoint(pages=6, slot=2)]),
                            Context())
    assert stored.stored == 7
    assert servicer.Stats(pb.StatsRequest(), Context()).workers == 1
    assert ending.is_alive()  # still waiting for its copies
    done.set()
    ending.join(10)
    assert not ending.is_alive() and len(servicer.registry) == 1
    servicer.registry.remove_all()
    handover.stop()
    for one in shared:
        one.close()
    engine.close()
