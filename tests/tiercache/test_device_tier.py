"""The device tier's logic without a GPU: an arena in CPU memory stands in for the GPU
arena (the same SlotArena, the same copy path between arenas), so stores land there
first, go down to the host behind them, evictions move what has no copy below, and
every prompt comes back exact from whichever tier holds it. The same scenario runs on a
real GPU in tests/gpu/test_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest

from drills.worlds import (cpu_device_tier, hybrid_layout, page_bytes, prompt_keys, random_buffers,
                          same, slot_bytes)
from tiercache.engine import Engine, EngineConfig
from tiercache.policy import PolicyConfig, WriteConfig
from tiercache.results import Tier
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig

LAYOUT = hybrid_layout(page_rows=64, slot_rows=8)
PAGES = 8
PROMPT = PAGES * LAYOUT.page_bytes + LAYOUT.checkpoint_bytes


def engine_with_a_device_tier(tmp_path, writes: str, host_slab: int | None = None) -> Engine:
    host = HostConfig(budget_bytes=3 * PROMPT, pin=False)
    engine = Engine.open(EngineConfig(
        host=host if host_slab is None else dataclasses.replace(host, slab_bytes=host_slab),
        disk=DiskConfig(str(tmp_path), map_size=1 << 26, sync=False),
        policy=PolicyConfig(writes=WriteConfig(host=writes))))
    return cpu_device_tier(engine, 2 * PROMPT, PROMPT // 2)


@pytest.mark.parametrize("writes", ["back", "through"])
@pytest.mark.parametrize("host_slab", [None, PROMPT // 5], ids=["default-host-slabs", "small-host-slabs"])
def test_prompts_go_down_the_tiers_and_come_back_exact(tmp_path, writes, host_slab):
    # small host slabs: a prompt's copy down spans several (copied a slab at a time)
    engine = engine_with_a_device_tier(tmp_path, writes, host_slab)
    source = random_buffers(LAYOUT, seed=1)
    prompts = [prompt_keys(LAYOUT, seed=n, pages=PAGES) for n in range(6)]
    # six prompts through a device tier for two and a host tier for three
    for n, keys in enumerate(prompts):
        rows = range(n * PAGES, (n + 1) * PAGES)
        assert engine.store(source, keys, rows, {PAGES: n % 8}).stored == PAGES + 1
    engine.drain()
    tiers = set()
    other = random_buffers(LAYOUT, seed=2)
    for n, keys in reversed(list(enumerate(prompts))):  # newest first
        result = engine.load(other, keys, range(56, 64), slot=7)
        assert result.match.pages == PAGES, f"prompt {n} was lost"
        assert same(page_bytes(other, range(56, 64)), page_bytes(source, range(n * PAGES, (n + 1) * PAGES)))
        assert same(slot_bytes(other, 7), slot_bytes(source, n % 8))
        tiers |= set(result.bytes_from)
    assert {Tier.DEVICE, Tier.HOST, Tier.DISK} <= tiers
    counters = engine.stats().counters
    assert counters["copied_down"] > 0 and counters["evicted_device"] > 0
    engine.close()


def test_one_load_takes_some_pages_from_the_device_and_the_rest_from_the_host(tmp_path):
    engine = engine_with_a_device_tier(tmp_path, "back")
    source = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=PAGES)
    engine.store(source, keys, range(PAGES), {PAGES: 0})
    gone = keys[0:PAGES - 1:3]  # every third page but the last (its key is the checkpoint's too)
    assert engine.evict(gone, Tier.DEVICE) == len(gone)
    other = random_buffers(LAYOUT, seed=2)
    rows = [63, 5, 40, 17, 58, 2, 31, 12]  # one a page, scattered
    result = engine.load(other, keys, rows, slot=3)
    assert result.match.pages == PAGES and set(result.bytes_from) == {Tier.DEVICE, Tier.HOST}
    assert same(page_bytes(other, rows), page_bytes(source, range(PAGES)))
    assert same(slot_bytes(other, 3), slot_bytes(source, 0))
    engine.close()


def test_evicting_the_device_tier_alone_copies_down_first(tmp_path):
    engine = engine_with_a_device_tier(tmp_path, "back")
    source = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=PAGES)
    engine.store(source, keys, range(PAGES), {PAGES: 0})
    assert engine.evict(keys, Tier.DEVICE) == PAGES + 1
    other = random_buffers(LAYOUT, seed=2)
    result = engine.load(other, keys, range(8, 16), slot=1)
    assert set(result.bytes_from) == {Tier.HOST} and result.match.pages == PAGES
    assert same(page_bytes(other, range(8, 16)), page_bytes(source, range(PAGES)))
    engine.close()
