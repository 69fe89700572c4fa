"""Two embedded engines sharing one real Redis Cluster as their remote tier: what one
stores, the other matches beyond its local hit (reported as Tier.REMOTE) and loads byte
for byte through a host slot; a node going down costs remote pages, never local ones."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from tests.redis_cluster import Cluster, needs_redis, redis_cluster
from drills.worlds import (hybrid_layout, page_bytes, prompt_keys, random_buffers,
                                     same, slot_bytes)
from tiercache.engine import Engine, EngineConfig
from tiercache.events import REMOTE_MEDIUM, EventLog
from tiercache.hashing import key_array
from tiercache.results import Kind, StopReason, Tier
from tiercache.remote import RemoteTierConfig
from tiercache.layout import BufferSpec, Layout
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig
from tiercache.tiers.remote.store import RemoteConfig

pytestmark = needs_redis
MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    with redis_cluster(tmp_path_factory.mktemp("redis")) as running:
        yield running


def engine(cluster: Cluster, namespace: str, **store) -> Engine:
    remote = RemoteTierConfig(RemoteConfig(cluster.url, namespace=namespace, **store))
    return Engine.open(EngineConfig(host=HostConfig(budget_bytes=64 * MiB), remote=remote))


def test_a_prompt_stored_through_one_engine_is_loaded_byte_for_byte_by_another(cluster):
    namespace = uuid.uuid4().hex[:8]
    a, b = engine(cluster, namespace), engine(cluster, namespace)
    layout = hybrid_layout()
    keys = prompt_keys(layout, seed=1, pages=12)
    source = random_buffers(layout, seed=2)
    stored = a.store(source, keys, list(range(12)), checkpoints={6: 1, 12: 2})
    assert 12 in stored.checkpoints  # (admission may decline the one at 6)
    a.drain()  # the background writer has written the store to the cluster
    assert a.stats().counters["remote_written"] == 12 + len(stored.checkpoints)
    # B has nothing locally: the match is all remote, up to the checkpoint at page 12
    match = b.match(layout, keys)
    assert (match.pages, match.stop) == (12, StopReason.END_OF_PROMPT)
    assert match.page_tiers == (Tier.REMOTE,) * 12 and match.checkpoint_tier is Tier.REMOTE
    dest = random_buffers(layout, seed=3)
    loaded = b.load(dest, keys, list(range(20, 32)), slot=5)
    assert loaded.match.pages == 12
    assert same(page_bytes(dest, range(20, 32)), page_bytes(source, range(12)))
    assert same(slot_bytes(dest, 5), slot_bytes(source, 2))
    # the entries are B's host entries now: the next match is local
    assert b.match(layout, keys).page_tiers == (Tier.HOST,) * 12
    stats = b.stats().counters
    assert stats["remote_fetched"] == 13 and stats["matched_pages_remote"] == 12
    assert stats["bytes_remote_to_host"] == 12 * layout.page_bytes + layout.checkpoint_bytes
    a.close(), b.close()


def test_the_remote_tier_extends_a_local_hit_and_its_checkpoint(cluster):
    namespace = uuid.uuid4().hex[:8]
    a, b = engine(cluster, namespace), engine(cluster, namespace)
    layout = hybrid_layout()
    keys = prompt_keys(layout, seed=4, pages=10)
    source = random_buffers(layout, seed=5)
    a.store(source, keys, list(range(10)), checkpoints={10: 0})
    a.drain()
    # B holds the first 4 pages and a checkpoint at 4 itself
    b.store(random_buffers(layout, seed=6), keys[:4], list(range(4)), checkpoints={4: 0},
            remote=False)
    match = b.match(layout, keys)
    assert match.pages == 10
    assert match.page_tiers == (Tier.HOST,) * 4 + (Tier.REMOTE,) * 6
    assert match.checkpoint_tier is Tier.REMOTE
    dest = random_buffers(layout, seed=7)
    assert b.load(dest, keys, list(range(30, 40)), slot=3).match.pages == 10
    assert same(page_bytes(dest, range(34, 40)), page_bytes(source, range(4, 10)))
    assert same(slot_bytes(dest, 3), slot_bytes(source, 0))
    a.close(), b.close()


def test_entries_kept_local_never_reach_the_remote_tier(cluster):
    namespace = uuid.uuid4().hex[:8]
    a, b = engine(cluster, namespace), engine(cluster, namespace)
    layout = hybrid_layout()
    keys = prompt_keys(layout, seed=8, pages=4)
    a.store(random_buffers(layout, seed=9), keys, list(range(4)), checkpoints={4: 0}, remote=False)
    a.drain()
    assert a.stats().counters["remote_written"] == 0
    assert b.match(layout, keys).pages == 0
    a.close(), b.close()


def test_another_namespace_or_another_check_finds_nothing_remote(cluster):
    a = engine(cluster, uuid.uuid4().hex[:8])
    other = engine(cluster, uuid.uuid4().hex[:8])
    layout = hybrid_layout()
    keys = prompt_keys(layout, seed=10, pages=3)
    checks = np.arange(1, 4, dtype=np.uint64)
    a.store(random_buffers(layout, seed=11), keys, list(range(3)), checkpoints={3: 0}, checks=checks)
    a.drain()
    assert other.match(layout, keys).pages == 0  # another deployment's namespace
    same_ns = engine(cluster, a.config.remote.store.namespace)
    assert same_ns.match(layout, keys, checks=checks + 1).pages == 0  # a colliding prompt
    assert same_ns.match(layout, keys, checks=checks).pages == 3
    a.close(), other.close(), same_ns.close()


def test_a_killed_node_costs_remote_pages_never_a_local_hit(tmp_path):
    with redis_cluster(tmp_path / "redis") as cluster:
        namespace = uuid.uuid4().hex[:8]
        a, b = engine(cluster, namespace), engine(cluster, namespace)
        layout = hybrid_layout(page_rows=128)
        keys = prompt_keys(layout, seed=12, pages=40)
        source = random_buffers(layout, seed=13)
        a.store(source, keys, list(range(40)), checkpoints={n: 0 for n in (10, 20, 30, 40)})
        a.drain()
        b.store(source, keys[:5], list(range(5)), checkpoints={5: 0}, remote=False)
        cluster.nodes[0].kill()
        # B's own five pages always hit; the remote part ends where a killed node's page or
        # checkpoint is missing, never beyond it
        match = b.match(layout, keys)
        assert 5 <= match.pages <= 40
        dest = random_buffers(layout, seed=14)
        loaded = b.load(dest, keys, list(range(40, 80)), slot=1)
        assert 5 <= loaded.match.pages
        n = loaded.match.pages
        assert same(page_bytes(dest, range(40, 40 + n)), page_bytes(source, range(n)))
        errors = b.stats().counters
        assert errors["remote_errors_connection"] + errors["remote_errors_node_down"] >= 1
        a.close(), b.close()


def test_writes_to_the_remote_tier_are_kv_events_of_their_own(cluster):
    namespace = uuid.uuid4().hex[:8]
    a = engine(cluster, namespace)
    log = EventLog()
    a.attach_events(log)
    layout = hybrid_layout()
    keys = prompt_keys(layout, seed=15, pages=3)
    log.announce("m", key_array(keys), layout.page_tokens)
    a.store(random_buffers(layout, seed=16), keys, list(range(3)), checkpoints={3: 0})
    a.drain()
    events = log.take().events
    media = [(e.medium, e.kind, len(e.keys)) for e in events]
    assert ("CPU", Kind.PAGE, 3) in media and ("CPU", Kind.CHECKPOINT, 1) in media
    assert (REMOTE_MEDIUM, Kind.PAGE, 3) in media and (REMOTE_MEDIUM, Kind.CHECKPOINT, 1) in media
    a.close()


# -- the write-on-eviction policy: entries go to the cluster as they leave the node --------
PAGES = Layout(16, paged=hybrid_layout().paged)  # attention only: any cached page prefix hits
BIG = Layout(16, paged=(BufferSpec("kv", 64, (16, 2, 1024), "bfloat16"),))  # 64 KiB pages


def leaving_engine(cluster: Cluster, namespace: str, layout: Layout, host_pages: int,
                   disk: DiskConfig | None = None) -> Engine:
    remote = RemoteTierConfig(RemoteConfig(cluster.url, namespace=namespace), writes="evict")
    return Engine.open(EngineConfig(host=HostConfig(budget_bytes=host_pages * layout.page_bytes,
                                                    pin=False), disk=disk, remote=remote))


def test_on_eviction_entries_reach_the_cluster_as_they_leave_a_host_without_disk(cluster):
    namespace = uuid.uuid4().hex[:8]
    a, b = leaving_engine(cluster, namespace, PAGES, host_pages=8), engine(cluster, namespace)
    prompts = [prompt_keys(PAGES, seed=20 + i, pages=8) for i in range(4)]
    sources = [random_buffers(PAGES, seed=30 + i) for i in range(4)]
    a.store(sources[0], prompts[0], list(range(8)))
    a.drain()
    assert a.stats().counters["remote_written"] == 0  # nothing left the node yet
    assert b.match(PAGES, prompts[0]).pages == 0
    # 1. the next prompt fills the host: the first leaves for the cluster, whole
    a.store(sources[1], prompts[1], list(range(8)))
    assert a.stats().counters["remote_written"] == 8
    dest = random_buffers(PAGES, seed=40)
    assert b.load(dest, prompts[0], list(range(8, 16))).match.pages == 8
    assert same(page_bytes(dest, range(8, 16)), page_bytes(sources[0], range(8)))
    # 2. a prompt kept local pushes the second out (handed off); when it is pushed out in
    #    turn, it is dropped: it never reaches the cluster
    a.store(sources[2], prompts[2], list(range(8)), remote=False)
    a.store(sources[3], prompts[3], list(range(8)))
    assert b.match(PAGES, prompts[1]).pages == 8
    assert b.match(PAGES, prompts[2]).pages == 0
    # 3. an entry evicted on request is gone, not handed off
    assert a.evict(tier=Tier.HOST) == 8
    assert b.match(PAGES, prompts[3]).pages == 0
    assert a.stats().counters["remote_written"] == 16
    a.close(), b.close()


def test_on_eviction_disk_victims_are_read_and_handed_off_before_their_records_go(cluster, tmp_path):
    namespace = uuid.uuid4().hex[:8]
    disk = DiskConfig(str(tmp_path / "lmdb"), map_size=2 << 20, sync=False)
    a, b = leaving_engine(cluster, namespace, BIG, host_pages=4, disk=disk), engine(cluster, namespace)
    prompts = [prompt_keys(BIG, seed=50 + i, pages=12) for i in range(4)]
    sources = [random_buffers(BIG, seed=60 + i) for i in range(4)]
    for keys, source in zip(prompts, sources):  # 48 pages through 4 in the host, ~24 on disk
        a.store(source, keys, list(range(12)))
        a.drain()
    counters = a.stats().counters
    assert counters["evicted_disk"] >= 12 and counters["remote_written"] == counters["evicted_disk"]
    # the first prompt left the node (its own match finds it in the cluster only) ...
    assert a.match(BIG, prompts[0]).page_tiers == (Tier.REMOTE,) * 12
    dest = random_buffers(BIG, seed=70)
    assert b.load(dest, prompts[0], list(range(12, 24))).match.pages == 12  # ... for the cluster
    assert same(page_bytes(dest, range(12, 24)), page_bytes(sources[0], range(12)))
    assert counters["bytes_disk_to_remote"] == counters["remote_written"] * BIG.page_bytes
    a.close(), b.close()
