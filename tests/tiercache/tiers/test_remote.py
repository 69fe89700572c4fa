"""The remote tier against a real three-node Redis Cluster: entries round trip byte for
byte, spread over the nodes, and every failure the issue names (an evicted part, a
damaged value, a killed, paused or full node, a moved slot, another namespace) is a
counted miss or a skipped write, never a wrong hit."""

from __future__ import annotations

import inspect
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.polling import eventually
from tests.redis_cluster import Cluster, needs_redis, redis_cluster
from tiercache import tenancy
from tiercache.hashing import Namespace
from tiercache.results import Kind
from tiercache.tiers.remote import entry as fmt
from tiercache.tiers.remote.entry import EntryRef
from tiercache.tiers.remote.redis_cluster import RedisClusterStore
from tiercache.tiers.remote.adapters import open_store
from tiercache.tiers.remote.store import Entry, RemoteConfig, RemoteStore, Wanted

pytestmark = needs_redis
PART = 64 << 10  # small parts, so that entries of a few hundred KiB have several


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    with redis_cluster(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Cluster:
    """A cluster of its own, for tests that kill, pause or fill nodes."""
    with redis_cluster(tmp_path / "redis") as running:
        yield running


def open_for(cluster: Cluster, namespace: str | None = None, **settings) -> RedisClusterStore:
    config = RemoteConfig(cluster.url, namespace=namespace or uuid.uuid4().hex[:12],
                          part_bytes=PART, **settings)
    return open_store(config)


def entries(count: int, nbytes: int, kind: Kind = Kind.PAGE) -> list[Entry]:
    rng = np.random.default_rng(count * nbytes)
    return [Entry(EntryRef(kind, os.urandom(16)), depth=i + 1,
                  payload=memoryview(rng.integers(0, 256, nbytes, np.uint8)), check=i + 7)
            for i in range(count)]


def fetch(store: RemoteStore, stored: list[Entry]) -> tuple[list[bool], list[np.ndarray]]:
    targets = [np.zeros(e.payload.nbytes, np.uint8) for e in stored]
    got = store.get([Wanted(e.ref, e.payload.nbytes, e.check) for e in stored],
                    [memoryview(t) for t in targets])
    return list(got.ok), targets


def meta_key(store: RedisClusterStore, ref: EntryRef) -> bytes:
    return fmt.entry_keys(store.config.prefix, store.config.namespace, ref, 0).meta


def test_every_adapter_implements_the_whole_contract():
    # LMCache's rule for its connectors: each adapter has every call of the interface
    wanted = {name for name, _ in inspect.getmembers(RemoteStore, inspect.isfunction)
              if not name.startswith("_")}
    assert wanted == {"exists", "get", "put", "delete", "stats", "latency", "close"}
    for adapter in (RedisClusterStore,):
        for name in wanted:
            assert inspect.signature(getattr(adapter, name)).parameters.keys() == \
                inspect.signature(getattr(RemoteStore, name)).parameters.keys(), name


def test_pages_and_multi_part_checkpoints_round_trip_byte_for_byte(cluster):
    store = open_for(cluster)
    # pages of 100 KiB (two parts) and checkpoints of 1 MiB + 3 bytes (seventeen parts)
    stored = entries(12, 100 << 10) + entries(3, (1 << 20) + 3, Kind.CHECKPOINT)
    written = store.put(stored)
    assert (written.stored, written.present, written.skipped) == (15, 0, 0)
    # the metadata says what was stored: depth, size, parts, check
    metas = store.exists([e.ref for e in stored]).metas
    assert [(m.depth, m.nbytes, m.parts, m.check) for m in metas] == [
        (e.depth, e.payload.nbytes, fmt.part_count(e.payload.nbytes, PART), e.check) for e in stored]
    ok, targets = fetch(store, stored)
    assert ok == [True] * 15
    assert all(np.array_equal(t, np.asarray(e.payload)) for t, e in zip(targets, stored))
    # stored again: found present, not written twice
    assert store.put(stored).present == 15
    assert store.stats()["remote_bytes_read"] == sum(e.payload.nbytes for e in stored)
    store.close()


def test_an_entry_shares_one_slot_and_pages_spread_over_every_node(cluster):
    store = open_for(cluster)
    stored = entries(60, 3 * PART)
    store.put(stored)
    # one entry: its metadata and parts hash to one slot (one node, one pipeline)
    keys = fmt.entry_keys(store.config.prefix, store.config.namespace, stored[0].ref, 3)
    slots = {cluster.nodes[0].cli("cluster", "keyslot", k.decode()) for k in (keys.meta, *keys.parts)}
    assert len(slots) == 1
    # sixty entries: every node holds some of them
    owners = {cluster.owner(meta_key(store, e.ref)).port for e in stored}
    assert owners == {n.port for n in cluster.nodes}
    store.close()


def test_a_part_the_store_evicted_makes_its_entry_a_counted_miss(cluster):
    store = open_for(cluster)
    stored = entries(4, 3 * PART)
    store.put(stored)
    # Redis (allkeys-lru) evicts the middle part of entry 1 and nothing else
    keys = fmt.entry_keys(store.config.prefix, store.config.namespace, stored[1].ref, 3)
    cluster.owner(keys.meta).raw(b"DEL", keys.parts[1])
    ok, _ = fetch(store, stored)
    assert ok == [True, False, True, True]
    assert store.stats()["remote_damaged_part_missing"] == 1
    # the half entry's metadata goes, so a later demotion writes it whole again
    assert eventually(lambda: store.exists([stored[1].ref]).present == [False])
    assert store.put(stored).stored == 1
    assert fetch(store, stored)[0] == [True] * 4
    store.close()


def test_a_damaged_value_or_record_is_detected_and_never_served(cluster):
    store = open_for(cluster)
    stored = entries(3, 2 * PART)
    store.put(stored)
    # one byte of entry 0's second part flips; entry 2's metadata loses its last byte
    keys = fmt.entry_keys(store.config.prefix, store.config.namespace, stored[0].ref, 2)
    node = cluster.owner(keys.meta)
    byte = bytes([np.asarray(stored[0].payload)[PART + 5] ^ 0xFF])
    node.raw(b"SETRANGE", keys.parts[1], b"5", byte)
    meta = meta_key(store, stored[2].ref)
    record = store.exists([stored[2].ref])  # sound before the damage
    assert record.present == [True]
    cluster.owner(meta).raw(b"SETRANGE", meta, str(fmt.META_BYTES - 1).encode(), b"\x00")
    ok, targets = fetch(store, stored)
    assert ok == [False, True, False]
    stats = store.stats()
    assert stats["remote_damaged_checksum"] == 1 and stats["remote_damaged_meta"] == 1
    assert np.array_equal(targets[1], np.asarray(stored[1].payload))
    store.close()


def test_a_size_or_check_other_than_the_callers_is_a_miss(cluster):
    store = open_for(cluster)
    stored = entries(1, PART)
    store.put(stored)
    e = stored[0]
    target = memoryview(np.zeros(PART + 1, np.uint8))
    assert store.get([Wanted(e.ref, PART + 1)], [target]).ok == (False,)
    target = memoryview(np.zeros(PART, np.uint8))
    assert store.get([Wanted(e.ref, PART, check=e.check + 1)], [target]).ok == (False,)
    assert store.get([Wanted(e.ref, PART, check=e.check)], [target]).ok == (True,)
    assert store.stats()["remote_damaged_mismatch"] == 2
    store.close()


def test_two_namespaces_and_two_tenants_never_see_each_others_entries(cluster):
    # the same page key under two namespaces: two entries, neither visible to the other
    mine, theirs = open_for(cluster, "fleet-a"), open_for(cluster, "fleet-b")
    stored = entries(2, PART)
    mine.put(stored)
    assert theirs.exists([e.ref for e in stored]).present == [False, False]
    assert fetch(theirs, stored)[0] == [False, False]
    # two tenants' namespaces on one cluster: the daemon masks keys per namespace
    # (tenancy.py), so the same worker key names two different remote entries
    secret = os.urandom(tenancy.SECRET_BYTES)
    worker_key = np.frombuffer(os.urandom(16), "<u8").reshape(1, 2)
    roots = (Namespace("m", "layout", tenant).root() for tenant in ("acme", "globex"))
    a, b = (tenancy.masked(worker_key, tenancy.namespace_mask(secret, r)).tobytes() for r in roots)
    mine.put([Entry(EntryRef(Kind.PAGE, a), 1, memoryview(b"x" * 100))])
    assert mine.exists([EntryRef(Kind.PAGE, b)]).present == [False]
    assert mine.exists([EntryRef(Kind.PAGE, a)]).present == [True]
    mine.close()
    theirs.close()


def test_a_killed_node_turns_its_entries_into_misses_while_the_rest_hit(fresh_cluster):
    store = open_for(fresh_cluster)
    stored = entries(30, 2 * PART)
    store.put(stored)
    victim = fresh_cluster.nodes[1]
    on_victim = [fresh_cluster.owner(meta_key(store, e.ref)) is victim for e in stored]
    assert 0 < sum(on_victim) < 30
    victim.kill()
    ok, targets = fetch(store, stored)
    assert ok == [not v for v in on_victim]
    assert all(np.array_equal(t, np.asarray(e.payload))
               for t, e, good in zip(targets, stored, ok) if good)
    # the next calls skip the dead node instead of waiting for it again
    assert store.exists([e.ref for e in stored]).present == ok
    stats = store.stats()
    assert stats["remote_errors_connection"] >= 1 and stats["remote_errors_node_down"] >= 1
    # writes to it are skipped and counted; the others are stored
    more = entries(30, PART)
    written = store.put(more)
    assert written.skipped > 0 and written.stored > 0 and written.stored + written.skipped == 30
    store.close()


def test_a_node_that_does_not_answer_costs_a_miss_within_the_budget(fresh_cluster):
    store = open_for(fresh_cluster, get_seconds=0.3)
    stored = entries(20, PART)
    store.put(stored)
    paused = fresh_cluster.nodes[0]
    on_paused = [fresh_cluster.owner(meta_key(store, e.ref)) is paused for e in stored]
    paused.pause()
    try:
        ok, _ = fetch(store, stored)
    finally:
        paused.resume()
    assert ok == [not p for p in on_paused]
    assert store.stats()["remote_errors_timeout"] >= 1
    assert fetch(store, stored)[0] == [True] * 20  # answered again: hits again
    store.close()


def test_redis_out_of_memory_skips_writes_and_counts_them(fresh_cluster):
    # the default policy, noeviction, refuses writes once maxmemory is reached
    for node in fresh_cluster.nodes:
        node.cli("config", "set", "maxmemory-policy", "noeviction")
        node.cli("config", "set", "maxmemory", "3mb")
    store = open_for(fresh_cluster)
    written = store.put(entries(40, 4 * PART))  # 10 MiB into 9 MiB
    assert written.skipped > 0 and written.stored > 0
    stats = store.stats()
    assert stats["remote_errors_oom"] >= 1 and stats["remote_put_skipped"] == written.skipped
    store.close()


def test_a_moved_slot_is_a_miss_then_found_on_its_new_node(fresh_cluster):
    store = open_for(fresh_cluster)
    stored = entries(1, 2 * PART)
    store.put(stored)
    assert fetch(store, stored)[0] == [True]
    # the entry's slot moves to another node, with its keys, behind the client's back
    meta = meta_key(store, stored[0].ref)
    source = fresh_cluster.owner(meta)
    target = next(n for n in fresh_cluster.nodes if n is not source)
    _move_slot(fresh_cluster, int(source.cli("cluster", "keyslot", meta.decode())), source, target)
    ok, _ = fetch(store, stored)
    assert ok == [False]
    assert store.stats()["remote_errors_moved"] == 1
    # the slot map is read again in the background; then the entry hits on its new node
    assert eventually(lambda: fetch(store, stored)[0] == [True])
    store.close()


def test_a_slot_in_migration_answers_ask_and_that_is_a_counted_miss(fresh_cluster):
    store = open_for(fresh_cluster)
    stored = entries(1, PART)
    store.put(stored)
    meta = meta_key(store, stored[0].ref)
    source = fresh_cluster.owner(meta)
    target = next(n for n in fresh_cluster.nodes if n is not source)
    slot = int(source.cli("cluster", "keyslot", meta.decode()))
    _move_slot(fresh_cluster, slot, source, target, finish=False)  # keys moved, slot not yet
    assert fetch(store, stored)[0] == [False]
    assert store.stats()["remote_errors_ask"] == 1
    store.close()


def test_a_cluster_unreachable_at_open_is_a_miss_not_an_error(tmp_path):
    config = RemoteConfig("redis-cluster://127.0.0.1:1", namespace="x", retry_seconds=60)
    store = open_store(config)
    stored = entries(2, 100)
    assert store.exists([e.ref for e in stored]).present == [False, False]
    assert store.put(stored).skipped == 2
    assert store.stats()["remote_errors_connection"] == 1  # one attempt, then it waits
    store.close()


def test_delete_removes_metadata_and_parts(cluster):
    store = open_for(cluster)
    stored = entries(3, 2 * PART)
    store.put(stored)
    assert store.delete([stored[0].ref, stored[1].ref]) == 2
    assert store.exists([e.ref for e in stored]).present == [False, False, True]
    keys = fmt.entry_keys(store.config.prefix, store.config.namespace, stored[0].ref, 2)
    node = cluster.owner(keys.meta)
    assert node.cli("exists", keys.parts[0].decode(), keys.parts[1].decode()) == "0"
    store.close()


def test_bad_settings_say_what_to_write():
    with pytest.raises(ValueError, match="redis-cluster://"):
        RemoteConfig("redis://a:1")
    with pytest.raises(ValueError, match="no user or password"):
        RemoteConfig("redis-cluster://:hunter2@a:1")
    with pytest.raises(ValueError, match="not host:port"):
        RemoteConfig("redis-cluster://a")
    with pytest.raises(ValueError, match="namespace"):
        RemoteConfig("redis-cluster://a:1", namespace="a}b")
    with pytest.raises(ValueError, match="proto-max-bulk-len|refuses"):
        RemoteConfig("redis-cluster://a:1", part_bytes=1 << 30)


def _move_slot(cluster: Cluster, slot: int, source, target, finish: bool = True) -> None:
    """Migrate one slot and its keys from `source` to `target`, as redis-cli --cluster
    reshard does, one step at a time."""
    src, dst = source.node_id(), target.node_id()
    target.cli("cluster", "setslot", str(slot), "importing", src)
    source.cli("cluster", "setslot", str(slot), "migrating", dst)
    keys = source.cli("cluster", "getkeysinslot", str(slot), "1000").split()
    if keys:
        source.cli("migrate", "127.0.0.1", str(target.port), "", "0", "5000", "keys", *keys)
    if finish:
        for node in cluster.nodes:
            node.cli("cluster", "setslot", str(slot), "node", dst)
