"""A store longer than one part (store.py's pipeline: keys claimed in parts of 512, 1,024,
..., each batch published after its copy while the next part is claimed; the first two
parts copied as one ahead of their claim where nobody holds their ends): the same result
and the same bytes as a store taken whole, and nothing left half-done when it stops part
way (no room, a failure, a caller that stopped waiting). The device tier takes a store as
one part, and a store's checkpoint is launched before its pages are waited for."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from drills.worlds import (cpu_device_tier, hybrid_layout, page_bytes, prompt_keys, random_buffers,
                          same, slot_bytes)
from tiercache import failpoints, store
from tiercache.engine import Engine, EngineConfig
from tiercache.errors import DeadlineExceeded, ResourceExhausted
from tiercache.failpoints import InjectedFault
from tiercache.hashing import key_array
from tiercache.invariants import violations
from tiercache.layout import BufferSpec, Layout
from tiercache.load import growing_parts
from tiercache.policy import AdmissionConfig, PolicyConfig
from tiercache.results import Kind
from tiercache.store import _parts
from tiercache.tiers.host import HostConfig

PAGES = 3000  # parts of 512, 1,024 and 1,464 keys
FIRST = 1536  # the first part, copied ahead of its claim (store._Flight.ahead): two parts
LAYOUT = Layout(16, paged=tuple(BufferSpec(f"kv{i}", 2 * PAGES, (16, 2, 8), "bfloat16")
                                for i in range(2)))  # pages only: a match needs no checkpoint


def open_engine(host_pages: int = 2 * PAGES) -> Engine:
    return Engine.open(EngineConfig(host=HostConfig(budget_bytes=host_pages * LAYOUT.page_bytes,
                                                    pin=False)))


def loaded(engine: Engine, keys, source, rows) -> int:
    """Pages a load brings whose bytes equal the source rows they were stored from."""
    target = random_buffers(LAYOUT, seed=99)
    got = engine.load(target, keys, range(PAGES, 2 * PAGES)).match.pages
    assert same(page_bytes(target, range(PAGES, PAGES + got)), page_bytes(source, rows[:got]))
    return got


def test_parts_cover_the_keys_once_in_order():
    for count in (0, 1, 7, 511, 512, 513, 2560, 2561, 12_000):
        for first in (1, 3, 512):
            covered = np.concatenate([np.arange(count)[p] for p in growing_parts(count, first)]
                                     or [np.empty(0, int)])
            assert covered.tolist() == list(range(count))
    assert [p.stop - p.start for p in _parts(3000, 4096)] == [512, 1024, 1464]
    # a store of SPLIT_BYTES or more starts with an eighth of its keys, if under 512
    assert [p.stop - p.start for p in _parts(21, 24 << 20)] == [2, 4, 15]
    assert [p.stop - p.start for p in _parts(5461, 96 << 10)] == [512, 1024, 3925]
    # copied ahead of its claim, the first part takes the first two
    assert [p.stop - p.start for p in _parts(5461, 96 << 10, ahead=True)] == [1536, 3925]
    assert [p.stop - p.start for p in _parts(100, 4096, ahead=True)] == [100]


def test_a_store_of_several_parts_counts_and_keeps_every_entry():
    engine, source = open_engine(), random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=PAGES)
    rows = np.random.default_rng(1).permutation(PAGES)
    # pages held already in each part: found, not written again
    held = [3, 600, 2700]
    for n in held:
        engine.store(source, keys[:n + 1][-1:], [int(rows[n])])  # one page, keyed as page n+1
    result = engine.store(source, keys, rows)
    assert (result.stored, result.present, result.skipped) == (PAGES - len(held), len(held), 0)
    assert engine.match(LAYOUT, keys).pages == PAGES
    assert loaded(engine, keys, source, rows) == PAGES
    assert violations(engine) == []
    engine.close()


def test_a_large_stores_checkpoints_claimed_in_parts_are_each_kept_exactly(monkeypatch):
    monkeypatch.setattr(store, "SPLIT_BYTES", 1)  # every store is large: parts of 1 and 3
    layout = hybrid_layout(page_rows=16, slot_rows=8)
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 24, pin=False),
                                      policy=PolicyConfig(admission=AdmissionConfig(offered="all"))))
    source, keys = random_buffers(layout, seed=4), prompt_keys(layout, seed=4, pages=8)
    offered = {2: 1, 4: 2, 6: 3, 8: 4}  # pages: slot
    assert engine.store(source, keys, range(8), checkpoints=offered).checkpoints == (2, 4, 6, 8)
    for pages, slot in offered.items():
        target = random_buffers(layout, seed=40 + pages)
        assert engine.load(target, keys[:pages], range(8, 8 + pages), slot=5).match.pages == pages
        assert same(slot_bytes(target, 5), slot_bytes(source, slot))
    assert violations(engine) == []
    engine.close()


def test_a_host_smaller_than_the_store_accounts_for_every_key():
    engine, source = open_engine(host_pages=1500), random_buffers(LAYOUT, seed=2)
    keys = prompt_keys(LAYOUT, seed=2, pages=PAGES)
    result = engine.store(source, keys, np.arange(PAGES))
    # the store's batches displace its own earlier ones (nothing below the host): its
    # batches in flight are published to make room, none is lost or counted twice
    assert (result.stored, result.present, result.skipped) == (PAGES, 0, 0)
    assert engine.match(LAYOUT, keys).kv_pages == 0  # the first pages are gone: no prefix
    assert violations(engine) == [] and engine.host.used_bytes <= 1500 * LAYOUT.page_bytes
    engine.close()


def test_no_room_in_any_part_refuses_the_store_and_keeps_no_claim():
    engine, source = open_engine(host_pages=1000), random_buffers(LAYOUT, seed=6)
    others = prompt_keys(LAYOUT, seed=60, pages=1000)
    engine.store(source, others, range(1000))
    held = engine.books.rows_of(Kind.PAGE, key_array(others))
    engine.books.pin(held)  # as loads in flight would: nothing to evict
    keys = prompt_keys(LAYOUT, seed=6, pages=PAGES)
    with pytest.raises(ResourceExhausted, match="no room in the host tier"):
        engine.store(source, keys, np.arange(PAGES))
    engine.books.unpin(held)
    assert len(engine.index) == 1000 and violations(engine) == []
    engine.close()


def test_a_failure_after_the_first_batch_publishes_what_was_whole_and_frees_the_rest():
    engine, source = open_engine(), random_buffers(LAYOUT, seed=3)
    keys = prompt_keys(LAYOUT, seed=3, pages=PAGES)
    rows = np.arange(PAGES)
    calls = []

    def second_fails(_name):
        calls.append(1)
        if len(calls) == 2:
            raise InjectedFault("the second batch's publish")
    with failpoints.armed("store.before_publish", second_fails), pytest.raises(InjectedFault):
        engine.store(source, keys, rows)
    # the first part (copied ahead: 1,536 keys, one batch) was published; nothing after
    # it is visible, no claim is left, and the slots of the batches after it are free again
    assert engine.match(LAYOUT, keys).pages == FIRST
    assert loaded(engine, keys, source, rows) == FIRST
    assert engine.host.used_bytes == FIRST * LAYOUT.page_bytes
    assert len(engine.index) == FIRST and violations(engine) == []
    # the same store again completes it
    assert engine.store(source, keys, rows).stored == PAGES - FIRST
    assert loaded(engine, keys, source, rows) == PAGES
    engine.close()


def test_a_caller_that_stops_waiting_gets_no_batch_published_after_that():
    engine, source = open_engine(), random_buffers(LAYOUT, seed=4)
    keys = prompt_keys(LAYOUT, seed=4, pages=PAGES)
    answers = iter([True, False])
    with pytest.raises(DeadlineExceeded):
        engine.store(source, keys, np.arange(PAGES), alive=lambda: next(answers, False))
    assert engine.match(LAYOUT, keys).pages == FIRST
    assert engine.host.used_bytes == FIRST * LAYOUT.page_bytes and violations(engine) == []
    engine.close()


def test_keys_in_any_form_store_the_same_entries():
    engine, source = open_engine(), random_buffers(LAYOUT, seed=5)
    keys = prompt_keys(LAYOUT, seed=5, pages=PAGES)
    engine.store(source, key_array(keys), torch.arange(PAGES).tolist())
    assert loaded(engine, b"".join(keys), source, np.arange(PAGES)) == PAGES
    engine.close()


def test_evicting_for_tiny_entries_frees_what_their_slots_are_charged():
    """A 64-byte entry's slot takes 1 KiB of the budget: an eviction that made room in
    entry bytes freed 16 times the slack it meant to, leaving the host part empty."""
    tiny = Layout(16, paged=(BufferSpec("kv", 1 << 12, (64,), "uint8"),))
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=4 << 20, pin=False)))
    source = random_buffers(tiny, seed=7)
    capacity = (4 << 20) // 1024
    for start in range(0, 3 * capacity, 1000):
        keys = np.stack([np.arange(start, start + 1000) + 1, np.zeros(1000)], 1).astype(np.uint64)
        assert engine.store(source, keys, np.arange(1000)).stored == 1000
        if start >= capacity:  # full since: at most the slack (1% of the budget) stays free
            assert engine.stats().tiers[0].entries >= capacity - capacity // 100 - 1
    engine.close()


def test_slots_reserved_beside_an_eviction_that_fails_to_move_its_victims_go_back(tmp_path, monkeypatch):
    # write-back: making room means writing the coldest entries to disk first (Displaced);
    # when that raises, the slots the same reservation handed out must not stay taken
    from tiercache.policy import PolicyConfig, WriteConfig
    from tiercache.results import Tier
    from tiercache.tiers.disk import DiskConfig
    engine = Engine.open(EngineConfig(
        host=HostConfig(budget_bytes=600 * LAYOUT.page_bytes, pin=False),
        disk=DiskConfig(str(tmp_path), map_size=1 << 26, sync=False),
        policy=PolicyConfig(writes=WriteConfig(host="back"))))
    source = random_buffers(LAYOUT, seed=5)
    engine.store(source, prompt_keys(LAYOUT, seed=5, pages=600), range(600))  # the host is full
    settled, settle = [], engine.stores.mover.settle

    def failing(displaced):  # the victims are let go, then something raises
        settled.append(settle(displaced))
        raise RuntimeError("the move of the victims failed")
    monkeypatch.setattr(engine.stores.mover, "settle", failing)
    with pytest.raises(RuntimeError, match="victims"):
        engine.store(source, prompt_keys(LAYOUT, seed=6, pages=300), range(300))
    assert settled  # the eviction did displace entries
    rows = engine.index.rows_in(Tier.HOST)
    assert engine.host.used_bytes == int(engine.index.column("nbytes", rows).sum())
    assert violations(engine) == []
    engine.close(flush=False)


def test_a_device_tier_store_is_one_launch_per_group_and_waits_once_both_are_launched():
    layout = hybrid_layout(page_rows=2 * PAGES, slot_rows=4)
    prompt = PAGES * layout.page_bytes + layout.checkpoint_bytes
    engine = cpu_device_tier(Engine.open(EngineConfig(host=HostConfig(budget_bytes=2 * prompt, pin=False))),
                             2 * prompt, prompt)
    transfer = engine.transfer
    source = random_buffers(layout, seed=8)
    steps, gather, fence = [], transfer.gather, transfer.fence

    def gathering(buffers, offsets, rows, parts):
        steps.append(("launch", "pages" if buffers is source.paged else "checkpoint", len(rows)))
        gather(buffers, offsets, rows, parts)

    def fencing(direction, *args, **kwargs):
        done = fence(direction, *args, **kwargs)
        if direction != "store":  # the copies down behind the store
            return done
        waited = done.synchronize
        done.synchronize = lambda: (steps.append(("wait",)), waited())[1]
        return done
    transfer.gather, transfer.fence = gathering, fencing
    keys = prompt_keys(layout, seed=8, pages=PAGES)
    assert engine.store(source, keys, range(PAGES), {PAGES: 3}).stored == PAGES + 1
    # the pages as one part (not 512, 1,024, ...), the checkpoint launched before any wait
    assert steps == [("launch", "pages", PAGES), ("launch", "checkpoint", 1), ("wait",), ("wait",)]
    transfer.gather, transfer.fence = gather, fence
    target = random_buffers(layout, seed=9)
    assert engine.load(target, keys, range(PAGES, 2 * PAGES), slot=1).match.pages == PAGES
    assert same(page_bytes(target, range(PAGES, 2 * PAGES)), page_bytes(source, range(PAGES)))
    assert same(slot_bytes(target, 1), slot_bytes(source, 3))
    assert violations(engine) == []
    engine.close()


def test_pages_that_find_no_room_take_their_checkpoint_with_them():
    layout = hybrid_layout(page_rows=64, slot_rows=4)
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=8 * layout.page_bytes, pin=False)))
    source = random_buffers(layout, seed=10)
    held_keys = prompt_keys(layout, seed=11, pages=8)
    engine.store(source, held_keys, range(8))
    held = engine.books.rows_of(Kind.PAGE, key_array(held_keys))
    engine.books.pin(held)  # as loads in flight would: nothing to evict
    keys = prompt_keys(layout, seed=10, pages=4)
    with pytest.raises(ResourceExhausted, match="no room in the host tier"):
        engine.store(source, keys, range(8, 12), {4: 0})
    engine.books.unpin(held)
    # neither the pages nor the checkpoint: a checkpoint needs its pages to be worth anything
    assert len(engine.index) == 8 and violations(engine) == []
    engine.close()


def spy(monkeypatch, owner, name: str, calls: list) -> None:
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: (calls.append(name), real(*args, **kwargs))[1])


def test_the_first_part_is_copied_ahead_of_its_claim_where_nobody_holds_its_ends(monkeypatch):
    engine, source = open_engine(), random_buffers(LAYOUT, seed=5)
    keys = prompt_keys(LAYOUT, seed=5, pages=PAGES)
    rows = np.random.default_rng(5).permutation(PAGES)
    engine.store(source, keys[10:11], [int(rows[10])])  # page 11, inside the first part
    calls: list[str] = []
    spy(monkeypatch, engine.transfer, "gather", calls)
    spy(monkeypatch, engine.books, "claim", calls)
    result = engine.store(source, keys, rows)
    assert calls[:3] == ["gather", "claim", "claim"]  # the first part went ahead
    assert (result.stored, result.present, result.skipped) == (PAGES - 1, 1, 0)
    assert loaded(engine, keys, source, rows) == PAGES
    assert violations(engine) == []  # the slot page 11 was copied into is free again
    # a part whose first key is held is claimed first, and copied after
    calls.clear()
    engine.evict(keys[1:])
    assert engine.store(source, keys, rows).stored == PAGES - 1
    assert calls[:2] == ["claim", "gather"] and violations(engine) == []
    engine.close()


def test_a_store_that_fails_once_its_first_part_went_ahead_leaves_nothing(monkeypatch):
    engine, source = open_engine(), random_buffers(LAYOUT, seed=6)
    keys = prompt_keys(LAYOUT, seed=6, pages=PAGES)
    rows = np.random.default_rng(6).permutation(PAGES)
    calls: list[str] = []
    spy(monkeypatch, engine.transfer, "gather", calls)

    def broken(*args, **kwargs):
        raise RuntimeError("the books failed")
    monkeypatch.setattr(engine.books, "stamp", broken)
    with pytest.raises(RuntimeError, match="books failed"):
        engine.store(source, keys, rows)
    assert calls == ["gather"]  # it had copied its first part
    monkeypatch.undo()
    assert engine.books.host.used_bytes == 0 and violations(engine) == []
    assert engine.store(source, keys, rows).stored == PAGES
    assert loaded(engine, keys, source, rows) == PAGES
    engine.close()


@pytest.mark.concurrent
def test_stores_of_overlapping_prompts_from_four_threads_keep_the_books_and_the_bytes():
    # the parts copied ahead of their claim race other stores of the same keys and the
    # evictions a small tier makes: every hit still loads the bytes stored under its key.
    # A store finding the whole tier in others' copies says so (ResourceExhausted), as
    # without parts ahead
    import threading
    engine, source = open_engine(host_pages=PAGES // 2), random_buffers(LAYOUT, seed=7)
    keys = prompt_keys(LAYOUT, seed=7, pages=PAGES)
    failures: list[BaseException] = []

    def work(seed: int) -> None:
        rng, target = np.random.default_rng(seed), random_buffers(LAYOUT, seed=100 + seed)
        try:
            for _ in range(20):
                start = int(rng.choice([0, 100, 700, 1500, 2200]))  # prompts that overlap
                stop = min(PAGES, start + int(rng.integers(100, 1300)))
                with contextlib.suppress(ResourceExhausted):
                    engine.store(source, keys[start:stop], range(start, stop))
                got = engine.load(target, keys, range(PAGES, 2 * PAGES)).match.pages
                assert same(page_bytes(target, range(PAGES, PAGES + got)), page_bytes(source, range(got)))
        except BaseException as error:  # noqa: BLE001 - reported below
            failures.append(error)
    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert violations(engine) == []
    engine.close()
