"""The engine with workers on a GPU: stores, loads (synchronous and asynchronous), disk
hits promoted or staged, and the background writer and promotions beside CUDA copies."""

import numpy as np
import pytest
import torch

from tiercache.buffers import WorkerBuffers
from tiercache.engine import Engine, EngineConfig
from tiercache.results import Tier
from tiercache.policy import PolicyConfig, WriteConfig
from tiercache.tiers.device import DeviceConfig
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig
from drills.worlds import hybrid_layout, prompt_keys, random_buffers
from tests.gpu.gpu_worker import sleep_gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

LAYOUT = hybrid_layout(page_rows=64, slot_rows=8)


def on_gpu(seed):
    cpu = random_buffers(LAYOUT, seed)
    return WorkerBuffers.bind(LAYOUT, [t.view(getattr(torch, s.dtype)).view(s.shape).cuda()
                                       for t, s in zip(cpu.paged, LAYOUT.paged)],
                              [t.view(getattr(torch, s.dtype)).view(s.shape).cuda()
                               for t, s in zip(cpu.slots, LAYOUT.slots)])


def rows_of(worker, rows):
    return [b[list(rows)].cpu() for b in worker.paged]


def state_of(worker, slot):
    return [b[slot].cpu() for b in worker.slots]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def open_engine(tmp_path=None, **writes):
    disk = DiskConfig(str(tmp_path), map_size=1 << 26, sync=False) if tmp_path else None
    return Engine.open(EngineConfig(
        host=HostConfig(budget_bytes=1 << 20, pin=True),
        disk=disk, policy=PolicyConfig(eviction="flop", writes=WriteConfig(**writes))))


@pytest.mark.concurrent  # it looks at pins while an asynchronous load is in flight
def test_a_gpu_store_and_asynchronous_load_round_trip_exactly():
    engine = open_engine()
    source, dest = on_gpu(1), on_gpu(2)
    keys = prompt_keys(LAYOUT, seed=1, pages=6)
    # 1. store six pages and the checkpoint at their end from GPU rows
    result = engine.store(source, keys, range(6), {6: 0})
    assert result.stored == 7 and result.checkpoints == (6,)
    # 2. an asynchronous load hands back an event; its entries stay pinned until it is done
    loaded = engine.load(dest, keys, range(10, 16), slot=3, asynchronous=True)
    assert loaded.match.pages == 6 and loaded.done is not None
    pinned = engine.index.rows_of(0, np.frombuffer(b"".join(keys), np.uint64).reshape(-1, 2))
    assert engine.index.column("pins", pinned).tolist() == [1] * 6
    loaded.done.synchronize()
    engine.quiesce(dest)
    assert engine.index.column("pins", pinned).tolist() == [0] * 6
    assert same(rows_of(dest, range(10, 16)), rows_of(source, range(6)))
    assert same(state_of(dest, 3), state_of(source, 0))
    engine.close()


@pytest.mark.parametrize("host_bytes, tier", [(1 << 20, Tier.HOST),
                                              (LAYOUT.checkpoint_bytes, Tier.DISK)])
def test_a_disk_hit_reaches_gpu_rows_promoted_or_staged(tmp_path, host_bytes, tier):
    source, dest = on_gpu(1), on_gpu(2)
    keys = prompt_keys(LAYOUT, seed=1, pages=4)
    # 1. one engine writes a prompt through to disk and closes
    writer = open_engine(tmp_path, host="through")
    writer.store(source, keys, range(4), {4: 0})
    writer.close()
    # 2. another opens the directory; with room its load promotes the pages to the host,
    # with a host smaller than a page it stages them in page-locked memory: either way the
    # GPU rows get the exact bytes
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=host_bytes, pin=True),
                                      disk=DiskConfig(str(tmp_path), map_size=1 << 26, sync=False)))
    assert set(engine.load(dest, keys, range(20, 24), slot=5).bytes_from) == {Tier.DISK}
    assert same(rows_of(dest, range(20, 24)), rows_of(source, range(4)))
    assert same(state_of(dest, 5), state_of(source, 0))
    assert engine.match(LAYOUT, keys).page_tiers[0] == tier
    engine.close()


def test_a_match_promotes_in_the_background_before_a_gpu_load(tmp_path):
    engine = open_engine(tmp_path, host="through")
    source, dest = on_gpu(1), on_gpu(2)
    keys = prompt_keys(LAYOUT, seed=1, pages=5)
    engine.store(source, keys, range(5), {5: 0})
    engine.drain()
    engine.evict(tier=Tier.HOST)
    # the match starts the promotion; the load waits for it if needed and reads the host
    engine.match(LAYOUT, keys, prefetch=True)
    loaded = engine.load(dest, keys, range(30, 35), slot=2)
    assert loaded.bytes_from == {Tier.HOST: 5 * LAYOUT.page_bytes + LAYOUT.checkpoint_bytes}
    assert same(rows_of(dest, range(30, 35)), rows_of(source, range(5)))
    engine.close()


def open_with_device(device_bytes, tmp_path=None):
    disk = DiskConfig(str(tmp_path), map_size=1 << 26, sync=False) if tmp_path else None
    return Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 22, pin=True), disk=disk,
                                    device=DeviceConfig(budget_bytes=device_bytes)))


def test_stores_land_in_the_device_tier_and_go_down_to_the_host_behind():
    engine = open_with_device(1 << 22)
    source, dest = on_gpu(1), on_gpu(2)
    keys = prompt_keys(LAYOUT, seed=1, pages=6)
    # 1. the store is a device-to-device copy: every entry is in the device tier at once
    assert engine.store(source, keys, range(6), {6: 0}).stored == 7
    assert engine.stats().tiers[0].tier == Tier.DEVICE and engine.stats().tiers[0].entries == 7
    # 2. a load by a worker on the same GPU reads the device copies
    loaded = engine.load(dest, keys, range(10, 16), slot=3)
    assert loaded.bytes_from == {Tier.DEVICE: 6 * LAYOUT.page_bytes + LAYOUT.checkpoint_bytes}
    assert same(rows_of(dest, range(10, 16)), rows_of(source, range(6)))
    assert same(state_of(dest, 3), state_of(source, 0))
    # 3. the background thread copies every entry down to the host
    engine.background.drain()
    host = [t for t in engine.stats().tiers if t.tier == Tier.HOST][0]
    assert host.entries == 7 and engine.stats().counters["copied_down"] == 7
    engine.close()


def test_a_small_device_tier_pushes_older_prompts_down_and_every_load_is_exact(tmp_path):
    # room for about one prompt on the device: the others live in the host (or on disk)
    engine = open_with_device(8 * LAYOUT.page_bytes + 2 * LAYOUT.checkpoint_bytes, tmp_path)
    source, dest = on_gpu(1), on_gpu(2)
    prompts = [prompt_keys(LAYOUT, seed=n, pages=6) for n in range(5)]
    for n, keys in enumerate(prompts):
        engine.store(source, keys, range(6 * n, 6 * n + 6), {6: n})
    tiers = set()
    for n, keys in enumerate(prompts):
        result = engine.load(dest, keys, range(40, 46), slot=7)
        tiers |= set(result.bytes_from)
        assert result.match.pages == 6
        assert same(rows_of(dest, range(40, 46)), rows_of(source, range(6 * n, 6 * n + 6)))
        assert same(state_of(dest, 7), state_of(source, n))
    assert Tier.DEVICE in tiers and Tier.HOST in tiers
    # closing writes everything down to disk; a new engine serves it from there
    engine.close()
    engine = open_with_device(1 << 22, tmp_path)
    assert engine.load(dest, prompts[0], range(40, 46), slot=7).bytes_from.keys() == {Tier.DISK}
    assert same(rows_of(dest, range(40, 46)), rows_of(source, range(6)))
    engine.close()


def test_a_prompt_larger_than_the_device_tier_goes_to_the_host_and_device_eviction_moves_down():
    # 1. the device tier holds two pages: the rest of a six-page prompt lands in the host
    engine = open_with_device(2 * LAYOUT.page_bytes)
    source, dest = on_gpu(1), on_gpu(2)
    keys = prompt_keys(LAYOUT, seed=1, pages=6)
    assert engine.store(source, keys, range(6), {6: 0}).stored == 7
    # 2. an asynchronous load pins its entries until its copy is done...
    engine.load(dest, keys, range(20, 26), slot=4, asynchronous=True).done.synchronize()
    # 3. ...then evicting from the device tier copies down what has no host copy yet
    engine.evict(keys, tier=Tier.DEVICE)
    assert engine.stats().tiers[0].entries == 0
    result = engine.load(dest, keys, range(10, 16), slot=3)
    assert result.match.pages == 6 and set(result.bytes_from) == {Tier.HOST}
    assert same(rows_of(dest, range(10, 16)), rows_of(source, range(6)))
    engine.close()


@pytest.mark.concurrent  # it returns with its loads in flight
@pytest.mark.parametrize("device_tier", [False, True])
def test_asynchronous_loads_behind_the_workers_own_gpu_work_return_before_it_is_done(device_tier):
    # A load's copies wait on the GPU for the worker's ready event, never on the host: with
    # seconds of the worker's work queued ahead of that event, the load returns at once,
    # and so does another worker's load queued behind it on the engine's streams. (The
    # first launch of each kind of copy loads its kernel, which waits for the device:
    # these loads ran once before.)
    engine = open_with_device(1 << 22) if device_tier else open_engine()
    source, first, second = on_gpu(1), on_gpu(2), on_gpu(3)
    keys = prompt_keys(LAYOUT, seed=1, pages=6)
    engine.store(source, keys, range(6), {6: 0})
    engine.background.drain()
    engine.load(first, keys, range(10, 16), slot=3)
    engine.load(second, keys, range(20, 26), slot=4)
    for worker in (first, second):  # what the loads below must bring again
        for buffer in (*worker.paged, *worker.slots):
            buffer.zero_()
    torch.cuda.synchronize()
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        sleep_gpu(3)
        ready = torch.cuda.Event()
        ready.record(busy)
    loads = [engine.load(first, keys, range(10, 16), slot=3, ready=ready, asynchronous=True),
             engine.load(second, keys, range(20, 26), slot=4, asynchronous=True)]
    assert not busy.query()  # both returned while the worker's own work still ran
    assert all(load.match.pages == 6 for load in loads)
    for load in loads:
        load.done.synchronize()
    assert same(rows_of(first, range(10, 16)), rows_of(source, range(6)))
    assert same(state_of(first, 3), state_of(source, 0))
    assert same(rows_of(second, range(20, 26)), rows_of(source, range(6)))
    engine.close()
