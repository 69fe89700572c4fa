"""The publish-after-commit drill's world: an engine with a small host over LMDB, workers
that store keyed content and loaders that check every byte they load (run under
failpoints by tests/reliability/test_publish.py and benchmarks/publish_drill.py)."""

from __future__ import annotations

import random

from drills import keyed
from drills.worlds import hybrid_layout, prompt_keys, random_buffers
from tiercache.engine import Engine, EngineConfig
from tiercache.errors import ResourceExhausted
from tiercache.failpoints import InjectedFault
from tiercache.policy import PolicyConfig, WriteConfig
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig

LAYOUT = hybrid_layout(page_rows=64, slot_rows=8)
PAGES = 4


def open_engine(tmp_path, host_pages=1000, writes="through") -> Engine:
    return Engine.open(EngineConfig(
        host=HostConfig(budget_bytes=host_pages * LAYOUT.page_bytes, pin=False),
        disk=DiskConfig(str(tmp_path), map_size=1 << 26, sync=False),
        policy=PolicyConfig(writes=WriteConfig(host=writes))))


def stored(engine, seed, rows=range(PAGES), slot=0):
    """A worker that stores prompt `seed` from `rows` and `slot`, with keyed content."""
    buffers, keys = random_buffers(LAYOUT, seed), prompt_keys(LAYOUT, seed, PAGES)
    keyed.fill(buffers.paged, buffers.slots, keys, list(rows), slot)
    return buffers, keys


def load_checked(engine, keys, rows=range(10, 10 + PAGES), slot=5) -> int:
    """Load into poisoned rows of a fresh worker; the pages loaded (asserted exact)."""
    buffers = random_buffers(LAYOUT, seed=99)
    keyed.poison(buffers.paged), keyed.poison(buffers.slots)
    pages = engine.load(buffers, keys, list(rows), slot).match.pages
    assert keyed.wrong_entries(buffers.paged, buffers.slots, keys, list(rows), pages, slot) == 0
    return pages


def storer(engine, seeds, stop, errors):
    while not stop.is_set():
        seed = random.choice(seeds)
        buffers, keys = stored(engine, seed)
        try:
            if random.random() < 0.5:  # so that the store writes and publishes anew
                engine.evict(keys)
            engine.store(buffers, keys, range(PAGES), {PAGES: 0})
        except (InjectedFault, ResourceExhausted):
            pass
        except Exception as error:  # noqa: BLE001 - reported by the test
            errors.append(error)


def loader(engine, seeds, stop, errors, loaded):
    while not stop.is_set():
        keys = prompt_keys(LAYOUT, random.choice(seeds), PAGES)
        try:
            loaded.append(load_checked(engine, keys))
        except InjectedFault:
            pass
        except Exception as error:  # noqa: BLE001 - a wrong entry is an AssertionError
            errors.append(error)
