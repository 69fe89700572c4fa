"""A disk tier that fills up keeps working: eviction can always delete.

LMDB copies every page a transaction changes, deletes included. Found by the soak: once
small entries had filled the map (long before their bytes reached the budget, LMDB's
overhead per small entry being large), the deletes of eviction failed with MapFull too,
and the tier refused every write from then on.
"""

from __future__ import annotations

from drills import keyed
from drills.worlds import prompt_keys, random_buffers
from tiercache.engine import Engine, EngineConfig
from tiercache.layout import BufferSpec, Layout
from tiercache.policy import PolicyConfig, WriteConfig
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig

SMALL = Layout(16, paged=(BufferSpec("kv", 64, (512,), "uint8"),))  # 512-byte pages


def test_a_map_full_of_small_entries_goes_on_evicting_and_serving(tmp_path):
    engine = Engine.open(EngineConfig(
        host=HostConfig(budget_bytes=256 * 512, pin=False),
        disk=DiskConfig(str(tmp_path), map_size=2 << 20, sync=False),
        policy=PolicyConfig(writes=WriteConfig(host="through"))))
    buffers = random_buffers(SMALL, seed=1)
    for seed in range(500):  # 4 MiB of pages through a 2 MiB map
        keys = prompt_keys(SMALL, seed, 16)
        keyed.fill(buffers.paged, [], keys, list(range(16)), None)
        engine.store_pages(buffers, keys, range(16))
        engine.drain()  # raised the disk tier's errors (MapFull on delete) before the fix
    counters = engine.stats().counters
    assert counters["evicted_disk"] > 0 and counters["disk_writes"] >= 500 * 16 - 256
    # and it still serves: the latest prompt loads exactly
    keys = prompt_keys(SMALL, 499, 16)
    keyed.poison(buffers.paged)
    assert engine.load(buffers, keys, list(range(20, 36))).match.pages == 16
    assert keyed.wrong_entries(buffers.paged, [], keys, list(range(20, 36)), 16, None) == 0
    engine.close()
