"""What the engine counts for its watchers: bytes per hop, copy times, matches by tier,
evictions and admissions by reason. Exact numbers after each scripted step."""

import pytest

from tiercache.engine import Engine, EngineConfig
from tiercache.results import Tier
from tiercache.metrics import BUCKETS, HOPS, Traffic
from tiercache.policy import PolicyConfig, WriteConfig
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig
from tests.tiercache.tiers.test_disk import flip_byte
from drills.worlds import hybrid_layout, prompt_keys, random_buffers

LAYOUT = hybrid_layout(page_rows=64, slot_rows=8)
PAGE, STATE = LAYOUT.page_bytes, LAYOUT.checkpoint_bytes


@pytest.fixture
def engine(tmp_path):
    config = EngineConfig(host=HostConfig(budget_bytes=100 * PAGE, pin=False),
                          disk=DiskConfig(str(tmp_path), map_size=1 << 26, sync=False),
                          policy=PolicyConfig(writes=WriteConfig(host="back")))
    engine = Engine.open(config)
    yield engine
    engine.close(flush=False)


def moved(engine):
    """Bytes per hop that are not zero."""
    return {hop: s.bytes for hop, s in engine.traffic.snapshot().items() if s.bytes}


def test_traffic_buckets_each_copy_by_its_duration():
    traffic = Traffic()
    # a 3 us copy lands in the first bucket, a 20 s copy past the last; an untimed one
    # adds bytes only
    traffic.record("host", "disk", 100, 3e-6)
    traffic.record("host", "disk", 50, 20.0)
    traffic.record("host", "disk", 7, None)
    hop = traffic.snapshot()[("host", "disk")]
    assert (hop.bytes, hop.copies, hop.seconds) == (157, 2, 20.0 + 3e-6)
    assert hop.counts[0] == 1 and hop.counts[len(BUCKETS)] == 1 and sum(hop.counts) == 2
    # a copy that fails is not recorded
    with pytest.raises(RuntimeError), traffic.timed("disk", "host", 10):
        raise RuntimeError("disk gone")
    assert traffic.snapshot()[("disk", "host")].bytes == 0
    with pytest.raises(KeyError):
        traffic.record("worker", "disk", 1, 0.1)  # not a hop any copy makes


def test_store_match_load_count_bytes_per_hop_and_matches_per_tier(engine):
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=5)
    # 1. a store copies 5 pages and a checkpoint from the worker into the host, in two batches
    engine.store(worker, keys, range(5), {5: 0})
    assert moved(engine) == {("worker", "host"): 5 * PAGE + STATE}
    assert engine.traffic.snapshot()[("worker", "host")].copies == 2
    # 2. a match of those 5 pages and 3 more finds 5 host pages and the host checkpoint
    engine.match(LAYOUT, keys + prompt_keys(LAYOUT, seed=9, pages=3))
    counters = engine.stats().counters
    assert (counters["requested_pages"], counters["matched_pages_host"],
            counters["matched_tokens_host"], counters["matched_checkpoints_host"]) == (8, 5, 80, 1)
    assert counters["matched_pages_disk"] == counters["matched_pages_device"] == 0
    # 3. flushed to disk and evicted from the host, a load reads disk -> host -> worker
    engine.flush()
    assert engine.evict(tier=Tier.HOST) == 6
    engine.load(random_buffers(LAYOUT, seed=2), keys, range(10, 15), slot=3)
    whole = 5 * PAGE + STATE
    assert moved(engine) == {("worker", "host"): whole, ("host", "disk"): whole,
                             ("disk", "host"): whole, ("host", "worker"): whole}
    counters = engine.stats().counters
    assert counters["bytes_disk_to_host"] == whole and counters["bytes_device_to_host"] == 0
    assert counters["evicted_host_by_request"] == 6 and counters["evicted_host"] == 0
    # every hop's copies were timed, none took a negative or absurd time
    for hop in HOPS:
        stats = engine.traffic.snapshot()[hop]
        assert sum(stats.counts) == stats.copies and 0 <= stats.seconds < 10


def test_admissions_and_evictions_by_reason(engine):
    worker = random_buffers(LAYOUT, seed=1)
    # 1. 120 pages into a 100-page host: the oldest are evicted (written to disk first)
    for n in range(4):
        engine.store(worker, prompt_keys(LAYOUT, seed=n, pages=30), range(30), {30: n})
    counters = engine.stats().counters
    assert (counters["stored_pages"], counters["skipped_pages"]) == (120, 0)
    assert counters["stored_checkpoints"] + counters["declined_checkpoints"] == 4
    assert counters["evicted_host"] >= 20 and counters["demoted"] == counters["evicted_host"]
    assert counters["evicted_host_by_request"] == counters["evicted_host_damaged"] == 0


def test_a_damaged_disk_entry_counts_as_evicted_damaged(tmp_path):
    config = EngineConfig(host=HostConfig(budget_bytes=100 * PAGE, pin=False),
                          disk=DiskConfig(str(tmp_path), map_size=1 << 26, sync=False))
    engine = Engine.open(config)
    keys = prompt_keys(LAYOUT, seed=5, pages=8)
    engine.store(random_buffers(LAYOUT, seed=1), keys, range(8), {8: 1})
    engine.close()
    # bit rot inside page 6 on disk; the reopened engine finds it on the load
    flip_byte(str(tmp_path), 0, keys[5], 100)
    engine = Engine.open(config)
    assert engine.load(random_buffers(LAYOUT, seed=2), keys, range(8), slot=0).damaged == 1
    counters = engine.stats().counters
    assert (counters["checksum_failures"], counters["evicted_disk_damaged"]) == (1, 1)
    engine.close()
