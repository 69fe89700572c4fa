import threading

import numpy as np
import pytest

from tiercache import load
from tiercache.engine import Engine, EngineConfig
from tiercache.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from tiercache.hashing import distinct_keys
from tiercache.results import Kind, StopReason, Tier
from tiercache.layout import Layout
from tiercache.policy import AdmissionConfig, PolicyConfig
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig
from drills.worlds import (hybrid_layout, page_bytes, prompt_keys, random_buffers, same,
                                     slot_bytes)
from tests.tiercache.tiers.test_disk import flip_byte

LAYOUT = hybrid_layout(page_rows=1100, slot_rows=24)
POLICY = PolicyConfig()


@pytest.fixture(autouse=True, params=["lru", "flop"])
def eviction(request, monkeypatch):
    """Every engine test runs under every eviction policy: the behaviour must hold for all."""
    monkeypatch.setitem(globals(), "POLICY", PolicyConfig(eviction=request.param))
    return request.param


def open_engine(tmp_path=None, host_bytes=1 << 28, disk_bytes=1 << 28, **policy):
    disk = DiskConfig(str(tmp_path), map_size=disk_bytes) if tmp_path else None
    config = EngineConfig(host=HostConfig(budget_bytes=host_bytes, pin=False), disk=disk,
                          policy=PolicyConfig(eviction=POLICY.eviction, **policy))
    return Engine.open(config)


def store_prompts(engine, worker, count=20, pages=50):
    """Store `count` prompts of `pages` pages, each from shuffled rows, with a checkpoint at
    its end from slot n; returns [(keys, source rows, source slot)]."""
    rows = np.random.default_rng(1).permutation(LAYOUT.page_rows)[:count * pages].reshape(count, pages)
    prompts = []
    for n in range(count):
        keys = prompt_keys(LAYOUT, seed=n, pages=pages)
        engine.store_pages(worker, keys, rows[n])
        engine.store_checkpoint(worker, keys, slot=n)
        prompts.append((keys, rows[n], n))
    return prompts


def check_round_trip(engine, prompts, source, expect_tier):
    other = random_buffers(LAYOUT, seed=99)  # another worker: other rows and slots
    dest_rows = np.random.default_rng(2).permutation(LAYOUT.page_rows)
    for n, (keys, src_rows, src_slot) in enumerate(prompts):
        dst = dest_rows[n * 50:(n + 1) * 50]
        result = engine.load(other, keys, dst, slot=23 - n)
        assert result.match.pages == 50 and result.match.stop == StopReason.END_OF_PROMPT
        assert set(result.match.page_tiers) == {expect_tier}
        assert result.bytes_from.get(expect_tier, 0) >= 50 * LAYOUT.page_bytes
        assert same(page_bytes(other, dst), page_bytes(source, src_rows))
        assert same(slot_bytes(other, 23 - n), slot_bytes(source, src_slot))


def test_round_trip_of_1000_pages_and_20_checkpoints_through_the_host():
    engine = open_engine()
    source = random_buffers(LAYOUT, seed=1)
    prompts = store_prompts(engine, source)
    assert engine.stats().tiers[0].entries == 1020
    check_round_trip(engine, prompts, source, Tier.HOST)


def test_round_trip_of_1000_pages_and_20_checkpoints_through_the_disk(tmp_path):
    engine = open_engine(tmp_path)
    source = random_buffers(LAYOUT, seed=1)
    prompts = store_prompts(engine, source)
    engine.close()  # flushes the host tier to LMDB
    engine = open_engine(tmp_path)  # a new process would see the same: an empty host, a full disk
    assert engine.stats().tiers[0].entries == 0 and engine.stats().tiers[1].entries == 1020
    check_round_trip(engine, prompts, source, Tier.DISK)
    # every disk hit was promoted: the same loads now come from the host
    check_round_trip(engine, prompts, source, Tier.HOST)
    engine.close()


def test_a_full_host_moves_its_coldest_entries_to_disk(tmp_path):
    # the host holds about 100 pages; 20 prompts of 50 pages pass through it
    engine = open_engine(tmp_path, host_bytes=100 * LAYOUT.page_bytes + 4 * LAYOUT.checkpoint_bytes)
    source = random_buffers(LAYOUT, seed=1)
    prompts = store_prompts(engine, source)
    host, disk = engine.stats().tiers
    assert host.used_bytes <= host.budget_bytes
    counters = engine.stats().counters
    # written ahead by the background writer or, when it lagged, by the eviction itself
    assert disk.entries + host.entries >= 1020 and counters["demoted"] + counters["disk_writes"] > 900
    # the oldest prompt lives on disk now, and still loads exactly
    check_round_trip(engine, prompts[:1], source, Tier.DISK)
    engine.close()


def test_tiny_budgets_evict_leaves_first_and_keep_prefixes_matchable(tmp_path):
    layout = Layout(16, paged=LAYOUT.paged)  # attention only, so every page prefix is a hit
    engine = open_engine(None, host_bytes=10 * layout.page_bytes)
    worker = random_buffers(layout, seed=3)
    first = prompt_keys(layout, seed=1, pages=10)
    engine.store_pages(worker, first, range(10))
    # a second prompt of 4 pages needs room: the 4 deepest pages of the first go
    second = prompt_keys(layout, seed=2, pages=4)
    engine.store_pages(worker, second, range(10, 14))
    assert engine.match(layout, first).pages == 6
    assert engine.match(layout, second).pages == 4
    assert engine.stats().counters["evicted_host"] == 4


def test_an_entry_larger_than_the_host_budget_is_refused_clearly():
    assert LAYOUT.page_bytes > LAYOUT.checkpoint_bytes
    engine = open_engine(None, host_bytes=LAYOUT.checkpoint_bytes)
    worker = random_buffers(LAYOUT, seed=3)
    keys = prompt_keys(LAYOUT, 1, 2)
    assert engine.store_checkpoint(worker, keys, slot=0).stored == 1  # a checkpoint fits
    with pytest.raises(ResourceExhausted, match="host budget"):
        engine.store_pages(worker, keys, [0, 1])  # a KV page never will


def test_restart_on_the_same_directory_still_hits(tmp_path):
    engine = open_engine(tmp_path)
    source = random_buffers(LAYOUT, seed=1)
    prompts = store_prompts(engine, source, count=3, pages=10)
    engine.close()
    engine = open_engine(tmp_path)
    for keys, _, _ in prompts:
        match = engine.match(LAYOUT, keys)
        assert match.pages == 10 and set(match.page_tiers) == {Tier.DISK}
    engine.close()


def stored_with_two_checkpoints(engine: Engine, pages: int, early: int):
    """A prompt's pages stored, with checkpoints after its first `early` pages (from
    slot 1) and at its end (slot 2): its source buffers and keys."""
    source = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=5, pages=pages)
    engine.store_pages(source, keys, range(pages))
    engine.store_checkpoint(source, keys[:early], slot=1)
    engine.store_checkpoint(source, keys, slot=2)
    return source, keys


def test_a_flipped_byte_in_lmdb_is_a_miss_never_served(tmp_path):
    engine = open_engine(tmp_path)
    source, keys = stored_with_two_checkpoints(engine, pages=8, early=4)
    engine.close()
    # bit rot inside page 6's value
    flip_byte(str(tmp_path), 0, keys[5], 100)
    engine = open_engine(tmp_path)
    assert engine.match(LAYOUT, keys).pages == 8  # the index cannot know yet
    other = random_buffers(LAYOUT, seed=9)
    result = engine.load(other, keys, range(100, 108), slot=5)
    # the load dropped page 6 and fell back to the checkpoint at page 4, whole and exact
    assert result.match.pages == 4 and result.damaged == 1
    assert same(page_bytes(other, range(100, 104)), page_bytes(source, range(4)))
    assert same(slot_bytes(other, 5), slot_bytes(source, 1))
    assert engine.stats().counters["checksum_failures"] == 1
    assert engine.match(LAYOUT, keys).pages == 4  # and it stays a miss
    engine.close()


def test_a_large_load_is_queued_in_growing_parts_and_fails_as_a_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "SPLIT_BYTES", 16 * LAYOUT.page_bytes)
    engine = open_engine(tmp_path)
    source, keys = stored_with_two_checkpoints(engine, pages=32, early=8)
    scattered = []

    def counted(engine):
        real = engine.transfer.scatter
        monkeypatch.setattr(engine.transfer, "scatter", lambda parts, buffers, offsets, rows: (
            scattered.append(len(rows)), real(parts, buffers, offsets, rows)))
    counted(engine)
    other = random_buffers(LAYOUT, seed=9)
    result = engine.load(other, keys, range(100, 132), slot=5)
    # an eighth of the pages, then parts twice as large, the last with the rest; the checkpoint
    assert result.match.pages == 32 and scattered == [4, 8, 20, 1]
    assert same(page_bytes(other, range(100, 132)), page_bytes(source, range(32)))
    assert same(slot_bytes(other, 5), slot_bytes(source, 2))
    scattered.clear()
    assert engine.load(other, keys[:8], range(100, 108), slot=5).match.pages == 8
    assert scattered == [8, 1]  # under SPLIT_BYTES: one part
    engine.close()
    # from disk, with a damaged page in the last part: dropped, and the load redone
    # shorter, whole and exact (the rows of its first parts are rewritten by the shorter load)
    flip_byte(str(tmp_path), 0, keys[20], 100)
    engine = open_engine(tmp_path)
    counted(engine)
    scattered.clear()
    other = random_buffers(LAYOUT, seed=10)
    result = engine.load(other, keys, range(200, 232), slot=6)
    assert result.match.pages == 8 and result.damaged == 1
    # the first two parts and the checkpoint (the last part was found damaged before its
    # copy), then the shorter load
    assert scattered == [4, 8, 1, 8, 1]
    assert same(page_bytes(other, range(200, 208)), page_bytes(source, range(8)))
    assert same(slot_bytes(other, 6), slot_bytes(source, 1))
    engine.close()


def test_a_store_that_fails_mid_copy_leaves_nothing_visible(monkeypatch):
    engine = open_engine()
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=5)

    def broken(*args):
        raise OSError("copy failed")
    monkeypatch.setattr(engine.transfer, "gather", broken)
    with pytest.raises(OSError):
        engine.store_pages(worker, keys, range(5))
    assert engine.match(Layout(16, paged=LAYOUT.paged), keys).pages == 0
    assert engine.stats().tiers[0].used_bytes == 0
    monkeypatch.undo()
    assert engine.store_pages(worker, keys, range(5)).stored == 5  # nothing stays claimed


def test_entries_a_load_reads_are_not_evicted_under_it():
    layout = Layout(16, paged=LAYOUT.paged)
    engine = open_engine(None, host_bytes=8 * layout.page_bytes)
    worker = random_buffers(layout, seed=1)
    keys = prompt_keys(layout, seed=1, pages=8)
    engine.store_pages(worker, keys, range(8))
    expected = page_bytes(worker, range(8))
    reading, release = threading.Event(), threading.Event()
    scatter = engine.transfer.scatter

    def slow_scatter(*args):
        reading.set()
        release.wait(10)
        scatter(*args)
    engine.transfer.scatter = slow_scatter
    other = random_buffers(layout, seed=2)
    loader = threading.Thread(target=engine.load, args=(other, keys, range(20, 28)))
    loader.start()
    assert reading.wait(10)
    # the host is full of pinned entries: a new store finds no room and says so
    with pytest.raises(ResourceExhausted):
        engine.store_pages(worker, prompt_keys(layout, seed=2, pages=2), range(8, 10))
    release.set()
    loader.join()
    assert same(page_bytes(other, range(20, 28)), expected)
    engine.transfer.scatter = scatter
    assert engine.store_pages(worker, prompt_keys(layout, seed=2, pages=2), range(8, 10)).stored == 2


def test_load_stops_at_the_rows_given_and_needs_a_checkpoint_there():
    engine = open_engine()
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=6)
    engine.store_pages(worker, keys, range(6))
    engine.store_checkpoint(worker, keys[:3], slot=0)
    engine.store_checkpoint(worker, keys, slot=1)
    other = random_buffers(LAYOUT, seed=2)
    # room for five pages only: the checkpoint at 6 is out of reach, the one at 3 is used
    result = engine.load(other, keys, range(10, 15), slot=4)
    assert result.match.pages == 3 and result.match.tokens == 48
    assert same(slot_bytes(other, 4), slot_bytes(worker, 0))


def test_explicit_evict_drops_entries_from_every_tier(tmp_path):
    engine = open_engine(tmp_path)
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=4)
    engine.store_pages(worker, keys, range(4))
    engine.store_checkpoint(worker, keys, slot=0)
    engine.flush()
    assert engine.evict(keys[2:]) == 3  # pages 3, 4 and the checkpoint at 4
    assert engine.match(Layout(16, paged=LAYOUT.paged), keys).pages == 2
    assert engine.evict() == 2
    assert [t.entries for t in engine.stats().tiers] == [0, 0]
    engine.close()
    assert len(open_engine(tmp_path).index) == 0


@pytest.mark.parametrize("call, message", [
    (lambda e, w, k: e.store_pages(w, k, [0, 1]), "3 page keys but 2 kv rows"),
    (lambda e, w, k: e.store_pages(w, k, [0, 1, 5000]), "5000 is out of range"),
    (lambda e, w, k: e.store_checkpoint(w, k, 99), "state slot 99"),
    (lambda e, w, k: e.store(w, k, [0, 1, 2], {2: 99}), "state slot 99"),
    (lambda e, w, k: e.store(w, k, [0, 1, 2], {4: 0}), "checkpoint at page 4"),
    (lambda e, w, k: e.store_checkpoint(w, [], 0), "page keys"),
    (lambda e, w, k: e.load(w, k, [1, 1, 2], 0), "repeat a row"),
    (lambda e, w, k: e.load(w, k, [1, 2, 3]), "state slot"),
    (lambda e, w, k: e.load(w, k, [-1], 0), "out of range"),
])
def test_bad_input_is_refused_and_changes_nothing(call, message):
    engine = open_engine()
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=3)
    with pytest.raises(InvalidArgument, match=message):
        call(engine, worker, keys)
    assert len(engine.index) == 0 and engine.stats().tiers[0].used_bytes == 0


def test_prefetch_moves_a_disk_hit_to_the_host(tmp_path):
    engine = open_engine(tmp_path)
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=6)
    engine.store_pages(worker, keys, range(6))
    engine.store_checkpoint(worker, keys, slot=0)
    engine.flush()
    # drop the host copies: the hit now lives on disk only
    assert engine.evict(tier=Tier.HOST) == 7
    assert set(engine.match(LAYOUT, keys).page_tiers) == {Tier.DISK}
    assert engine.prefetch(LAYOUT, keys) == 7
    match = engine.match(LAYOUT, keys)
    assert set(match.page_tiers) == {Tier.HOST} and match.checkpoint_tier == Tier.HOST
    assert engine.prefetch(LAYOUT, keys) == 0  # nothing left to move
    other = random_buffers(LAYOUT, seed=2)
    result = engine.load(other, keys, range(30, 36), slot=3)
    assert result.bytes_from == {Tier.HOST: 6 * LAYOUT.page_bytes + LAYOUT.checkpoint_bytes}
    assert same(page_bytes(other, range(30, 36)), page_bytes(worker, range(6)))
    engine.close()


def test_a_closed_engine_refuses_every_call():
    engine = open_engine()
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=2)
    engine.store_pages(worker, keys, [0, 1])
    engine.store_checkpoint(worker, keys, 0)
    engine.close()
    engine.close()  # a second close is harmless
    # without a disk tier the host held the only copy: nothing may hit any more
    for call in (lambda: engine.match(LAYOUT, keys), lambda: engine.load(worker, keys, [2, 3], 0),
                 lambda: engine.store_pages(worker, keys, [0, 1]),
                 lambda: engine.store_checkpoint(worker, keys, 0), engine.flush, engine.evict):
        with pytest.raises(FailedPrecondition, match="closed"):
            call()


@pytest.mark.parametrize("offered, kept", [("all", (3, 6)), ("policy", (6,))])
def test_store_takes_pages_and_the_checkpoints_offered_in_one_call(offered, kept):
    engine = open_engine(admission=AdmissionConfig(offered=offered))
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=6)
    # the admission policy keeps the end of a fresh prompt only; "all" keeps every offer
    result = engine.store(worker, keys, range(6), checkpoints={3: 0, 6: 1})
    assert (result.stored, result.present, result.checkpoints) == (6 + len(kept), 0, kept)
    again = engine.store(worker, keys, range(6), checkpoints={6: 1})
    assert (again.stored, again.present, again.checkpoints) == (0, 7, (6,))
    assert engine.match(LAYOUT, keys).pages == 6
    with pytest.raises(InvalidArgument, match="checkpoint at page 7"):
        engine.store(worker, keys, range(6), checkpoints={7: 0})


def test_a_store_that_repeats_a_key_is_refused_before_anything_changes():
    engine = open_engine()
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=3)
    # the second page's key sent again as the fourth: refused, naming the repeat
    with pytest.raises(InvalidArgument, match="key 3 repeats key 1"):
        engine.store(worker, keys + keys[1:2], [0, 1, 2, 3], {4: 0})
    assert len(engine.index) == 0 and engine.host.used_bytes == 0
    for call in (lambda: engine.match(LAYOUT, keys + keys[:1]),
                 lambda: engine.load(worker, keys + keys[:1], [5, 6, 7, 8], slot=1),
                 lambda: engine.evict(keys + keys[:1])):
        with pytest.raises(InvalidArgument, match="repeats"):
            call()
    # the same prompt without the repeat stores, loads and evicts as usual
    assert engine.store(worker, keys, [0, 1, 2], {3: 0}).stored == 4
    assert engine.load(worker, keys, [5, 6, 7], slot=1).match.pages == 3
    assert engine.evict(keys) == 4 and len(engine.index) == 0
    engine.close()


def test_entries_stored_under_another_layout_are_misses_never_reads():
    engine = open_engine()
    small = hybrid_layout(page_rows=8, slot_rows=2, paged=1, slots=1)  # smaller entries
    stored = random_buffers(small, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=3)
    engine.store(stored, keys, [0, 1, 2], {3: 0})
    # the same keys from a worker of another layout: no hit, its rows untouched
    worker = random_buffers(LAYOUT, seed=2)
    before = page_bytes(worker, range(LAYOUT.page_rows)) + slot_bytes(worker, 1)
    for call in (lambda: engine.match(LAYOUT, keys), lambda: engine.load(worker, keys, [5, 6, 7], slot=1)):
        match = call()
        match = getattr(match, "match", match)
        assert match.pages == 0 and match.stop == StopReason.MISSING_PAGE
    assert same(page_bytes(worker, range(LAYOUT.page_rows)) + slot_bytes(worker, 1), before)
    # and its store of those keys leaves the other layout's entries alone
    result = engine.store(worker, keys, [0, 1, 2], {3: 0})
    assert result.stored == 0 and result.skipped == 4
    assert engine.load(random_buffers(small, seed=3), keys, [4, 5, 6], slot=1).match.pages == 3


def test_a_layout_of_states_only_loads_its_checkpoint(tmp_path):
    # one Mamba group of vLLM as a registration of its own: slot buffers, no KV pages
    layout = Layout(16, slots=hybrid_layout(slot_rows=8).slots)
    source, other = random_buffers(layout, seed=1), random_buffers(layout, seed=2)
    engine = open_engine(tmp_path)
    keys = prompt_keys(layout, seed=3, pages=6)
    # the states after 2 and after 6 pages, from slots 1 and 5 (each the end of its store)
    engine.store(source, keys[:2], checkpoints={2: 1})
    engine.store(source, keys, checkpoints={6: 5})
    for tier in (Tier.HOST, Tier.DISK):  # from memory, then from disk alone
        # asked for 4 pages, the deepest state at or below is the one after 2
        assert engine.load(other, keys[:4], slot=3).match.pages == 2
        assert same(slot_bytes(other, 3), slot_bytes(source, 1))
        assert engine.load(other, keys, slot=0).match.pages == 6
        assert same(slot_bytes(other, 0), slot_bytes(source, 5))
        if tier == Tier.HOST:
            engine.flush()
            assert engine.evict(None, Tier.HOST) == 2
            other = random_buffers(layout, seed=4)
    engine.close()


def test_a_worker_away_from_the_device_tier_has_stores_copied_down_at_once():
    # it reads device entries from their host copies (Background.copy_down_at_once); a
    # CPU worker is one, from its first call
    engine = open_engine()
    assert engine.background.copy_down_delay > 0
    worker = random_buffers(LAYOUT, 1)
    engine.store(worker, prompt_keys(LAYOUT, seed=1, pages=4), range(4), {4: 0})
    assert engine.background.copy_down_delay == 0
    engine.close()


def test_entries_only_on_the_device_are_no_disk_entries_to_promote_or_load(tmp_path):
    # Entries a device-tier worker stored are only on the device until the background copies
    # them down. A prefetch (a Match's, or its own call) moves disk entries to the host, and
    # a worker away from the device reads host and disk entries: before the fix both took
    # these for disk entries, found no record and dropped them as damaged. The device tier
    # needs a GPU: its entries are made in the index directly.
    engine = open_engine(tmp_path)
    keys = prompt_keys(LAYOUT, seed=1, pages=4)
    chain = distinct_keys(keys)
    with engine.books.lock:
        pages = engine.books.index.publish(Kind.PAGE, chain, [1, 2, 3, 4], LAYOUT.page_bytes,
                                           Tier.DEVICE, slots=range(4))
        state = engine.books.index.publish(Kind.CHECKPOINT, chain[3:], [4], LAYOUT.checkpoint_bytes,
                                           Tier.DEVICE, slots=[100])
    match = engine.match(LAYOUT, keys, prefetch=True)
    assert match.pages == 4 and match.checkpoint_tier == Tier.DEVICE
    assert engine.prefetch(LAYOUT, keys) == 0
    # a worker away from the device tier's GPU (here on the CPU) reads device entries from
    # their host copies: until they are copied down, it misses them, and its Match says so
    away = random_buffers(LAYOUT, seed=2)
    assert engine.match(LAYOUT, keys, buffers=away).pages == 0
    loaded = engine.load(away, keys, range(10, 14), slot=1)
    assert loaded.match.pages == 0 and loaded.damaged == 0
    engine.drain()
    rows = np.concatenate([pages, state])
    assert engine.stats().counters["prefetches"] == 0
    assert engine.books.in_tier(rows, Tier.DEVICE).all()
