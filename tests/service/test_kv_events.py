"""KV events as a router sees them: a ZMQ subscriber decodes the stream with msgpack,
checks that stores, evictions per tier and clears arrive in order with vLLM's field
names and types, replays from a sequence number, and decodes every batch with vLLM's
own struct declarations (msgspec, strict types)."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
import zmq

from tiercache_service.kv_events import END_SEQ, KvEventPublisher, KvEventsConfig
from tiercache.events import REMOTE_MEDIUM, Change, EventLog, EventLogConfig
from tiercache.results import Tier


# -- vllm/distributed/kv_events.py as of v0.28: the struct options and fields, declared
# here so that the test fails if our encoding drifts from the schema routers decode ----
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def stream():
    """An event log, its publisher on loopback, and a subscriber to all of it."""
    log = EventLog(EventLogConfig(max_pending_keys=64))
    pub, replay = free_port(), free_port()
    config = KvEventsConfig(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}",
                            pod="node-a:5557", interval=0.01)
    publisher = KvEventPublisher(config, log).start()
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(config.endpoint)
    time.sleep(0.3)  # a SUB socket misses what is sent before it has joined
    yield log, publisher, sub, config
    sub.close(linger=0)
    publisher.stop()


def keys(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**63, (n, 2), dtype=np.uint64)


def receive(sub: zmq.Socket, batches: int) -> list[tuple[str, int, list]]:
    """(topic, sequence, decoded batch) of the next `batches` batches."""
    got = []
    for _ in range(batches):
        assert sub.poll(5000), "no batch arrived"
        topic, seq, payload = sub.recv_multipart()
        msgspec.msgpack.decode(payload, type=KVEventBatch)  # vLLM's own decoder accepts it
        got.append((topic.decode(), int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    return got


def test_stores_evictions_per_tier_and_clears_arrive_in_order_with_vllms_fields(stream):
    log, publisher, sub, _ = stream
    chain = keys(3, 1)
    tokens = np.arange(3 * 4)
    log.announce("qwen", chain, page_tokens=4, tokens=tokens)
    # the store lands in the host tier (CPU), its checkpoint at page 3 too; then the
    # pages go down to disk, and the host evicts pages 2 and 3
    log.record_tier(Change.STORED, np.array([0, 0, 0, 1]), Tier.HOST,
                    np.concatenate([chain, chain[2:]]))
    time.sleep(0.05)
    log.record_tier(Change.STORED, np.zeros(3), Tier.DISK, chain)
    log.record_tier(Change.REMOVED, np.zeros(2), Tier.HOST, chain[1:])
    (topic1, seq1, first), (topic2, seq2, second) = receive(sub, 2)
    assert topic1 == topic2 == "kv@node-a:5557@qwen"
    assert (seq1, seq2) == (0, 1)
    ts, events, rank = first
    assert isinstance(ts, float) and rank == 0
    key = [bytes(k.tobytes()) for k in chain]
    assert events == [
        {"type": "BlockStored", "block_hashes": key, "parent_block_hash": None,
         "token_ids": list(range(12)), "block_size": 4, "lora_id": None, "medium": "CPU",
         "lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockStored", "block_hashes": key[2:], "parent_block_hash": key[1],
         "token_ids": list(range(8, 12)), "block_size": 4, "lora_id": None, "medium": "CPU",
         "lora_name": None, "group_idx": 1, "kv_cache_spec_kind": "mamba"}]
    assert [e["type"] for e in second[1]] == ["BlockStored", "BlockRemoved"]
    assert second[1][0]["medium"] == "DISK"
    assert second[1][1] == {"type": "BlockRemoved", "block_hashes": key[1:], "medium": "CPU",
                            "group_idx": 0}


def test_keys_never_announced_are_never_published(stream):
    # another tenant's store is not announced: its entries stay out of the stream
    log, _, sub, _ = stream
    mine, theirs = keys(2, 2), keys(2, 3)
    log.announce("qwen", mine, page_tokens=16)
    log.record_tier(Change.STORED, np.zeros(4), Tier.HOST, np.concatenate([theirs, mine]))
    (_, _, batch), = receive(sub, 1)
    assert [e["block_hashes"] for e in batch[1]] == [[k.tobytes() for k in mine]]
    assert batch[1][0]["token_ids"] == []  # no tokens were given: hashes only
    assert not sub.poll(200)


def test_a_full_queue_drops_changes_and_tells_routers_to_start_over(stream):
    log, _, sub, _ = stream
    chain = keys(40, 4)
    log.announce("qwen", chain, page_tokens=16)
    for _ in range(4):  # 160 keys into a queue of 64, faster than 10 ms: some are dropped
        log.record_tier(Change.STORED, np.zeros(40), Tier.DISK, chain)
    assert log.dropped >= 40
    batches = []
    while not any(e["type"] == "AllBlocksCleared" for b in batches for e in b[1]):
        batches += [b for _, _, b in receive(sub, 1)]
    # the clear opens its batch: whatever a router learns after it is current
    assert batches[-1][1][0] == {"type": "AllBlocksCleared"}
    assert [e["type"] for e in batches[-1][1][1:]] in ([], ["BlockStored"])


def test_the_replay_endpoint_resends_from_a_sequence_and_ends_with_minus_one(stream):
    log, publisher, sub, config = stream
    for n in range(4):
        chain = keys(1, 10 + n)
        log.announce("qwen", chain, page_tokens=16)
        log.record_tier(Change.STORED, np.zeros(1), Tier.HOST, chain)
        receive(sub, 1)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(config.replay_endpoint)
    dealer.send_multipart((b"", (2).to_bytes(8, "big")))
    replies = []
    while True:
        assert dealer.poll(5000)
        _, seq, payload = dealer.recv_multipart()
        replies.append((int.from_bytes(seq, "big", signed=True), payload))
        if seq == END_SEQ:
            break
    dealer.close(linger=0)
    assert [s for s, _ in replies] == [2, 3, -1]
    assert replies[-1][1] == b""
    assert all(msgpack.unpackb(p)[1][0]["type"] == "BlockStored" for _, p in replies[:-1])
    assert publisher.replays == 1


def test_remote_tier_entries_go_under_the_shared_pseudo_pod(stream):
    log, _, sub, _ = stream
    chain = keys(2, 5)
    log.announce("qwen", chain, page_tokens=16)
    log.record(Change.STORED, np.zeros(2), REMOTE_MEDIUM, chain)
    (topic, _, batch), = receive(sub, 1)
    assert topic == "kv@tiercache-remote@qwen"
    assert batch[1][0]["medium"] == REMOTE_MEDIUM


def test_recording_never_waits_for_a_subscriber():
    # no subscriber at all, a tiny queue: recording returns and counts what it dropped
    log = EventLog(EventLogConfig(max_pending_keys=10))
    chain = keys(8, 6)
    log.announce("m", chain, page_tokens=16)
    for _ in range(1000):
        log.record_tier(Change.STORED, np.zeros(8), Tier.HOST, chain)
    assert log.dropped == 999 * 8
    taken = log.take()
    assert taken.lost and len(taken.events) == 1 and not log.take().lost


def test_a_port_in_use_is_refused_with_a_message():
    port = free_port()
    first = KvEventPublisher(KvEventsConfig(f"tcp://127.0.0.1:{port}"), EventLog()).start()
    try:
        with pytest.raises(ValueError, match="port taken"):
            KvEventPublisher(KvEventsConfig(f"tcp://127.0.0.1:{port}"), EventLog()).start()
    finally:
        first.stop()
    with pytest.raises(ValueError, match="tcp://"):
        KvEventsConfig("localhost:5557")


def test_a_daemon_publishes_a_workers_store_with_its_tokens_when_asked(tmp_path):
    from tests.service.daemon import running_daemon
    from tests.service.worker_process import LAYOUT, prompt
    from tiercache.client import Client

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with running_daemon(tmp_path, "--kv-events", endpoint, "--kv-events-pod", "pod-1") as (address, _):
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@pod-1@")
        sub.connect(endpoint)
        time.sleep(0.3)
        worker = Client(address).register("m1", LAYOUT)
        tokens = prompt(0)  # 6 full pages of 16 tokens and 5 more
        worker.store(tokens, kv_rows=range(6), checkpoints={96: 0}, publish_tokens=True)
        worker.store(prompt(1), kv_rows=range(6, 12))  # without tokens: hashes only
        events = []
        while len(events) < 3 and sub.poll(10_000):
            topic, _, payload = sub.recv_multipart()
            assert topic == b"kv@pod-1@m1"
            msgspec.msgpack.decode(payload, type=KVEventBatch)
            events += msgpack.unpackb(payload)[1]
        worker.close()
        sub.close(linger=0)
    pages, checkpoint, untold = events
    assert (pages["medium"], pages["block_size"], len(pages["block_hashes"])) == ("CPU", 16, 6)
    assert pages["token_ids"] == tokens[:96] and pages["parent_block_hash"] is None
    assert checkpoint["kv_cache_spec_kind"] == "mamba" and checkpoint["token_ids"] == tokens[80:96]
    assert checkpoint["parent_block_hash"] == pages["block_hashes"][4]
    assert untold["token_ids"] == [] and len(untold["block_hashes"]) == 6
