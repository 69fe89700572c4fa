import math

import numpy as np
import pytest

from tiercache.engine import Engine, EngineConfig
from tiercache.index import Candidates
from tiercache.results import Kind
from tiercache.layout import Layout
from tiercache.policy import PolicyConfig
from tiercache.tiers.host import HostConfig
from tiercache.tuning import AlphaTuner
from drills.worlds import hybrid_layout, prompt_keys, random_buffers

KEYS = np.arange(20, dtype=np.uint64).reshape(10, 2) + 1


def candidates(stamps, values):
    n = len(stamps)
    return Candidates(np.arange(n), np.array(stamps, np.uint64), np.ones(n, np.uint32),
                      np.zeros(n, np.uint8), np.full(n, 10, np.int64), np.array(values, np.float32))


def tuner(capacity=64):
    return AlphaTuner(1.0, capacity=capacity, rate=0.1)


def test_a_regretted_victim_of_recency_raises_alpha():
    t = tuner()
    # rows 0..3: row 0 is the oldest and the most valuable; it was evicted by recency
    t.evicted(candidates([1, 2, 3, 4], [9, 1, 1, 1]), np.array([0]), KEYS[:1])
    assert t.returned(Kind.PAGE, KEYS[:1]) == 1 and t.alpha == pytest.approx(math.exp(0.1))
    # settled once: the same key again changes nothing
    assert t.returned(Kind.PAGE, KEYS[:1]) == 0 and t.alpha == pytest.approx(math.exp(0.1))


def test_a_victim_both_terms_condemned_teaches_nothing():
    t = tuner()
    # row 0 is the oldest and the cheapest: LRU and value agree
    t.evicted(candidates([1, 2, 3, 4], [1, 5, 5, 5]), np.array([0]), KEYS[:1])
    assert not t.returned(Kind.PAGE, KEYS[:1]) and t.alpha == 1.0


def test_a_regretted_victim_of_value_lowers_alpha():
    t = tuner()
    # row 3 is the newest but worth the least: the value term condemned it
    t.evicted(candidates([1, 2, 3, 4], [5, 5, 5, 1]), np.array([3]), KEYS[3:4])
    assert t.returned(Kind.PAGE, KEYS[3:4]) and t.alpha == pytest.approx(math.exp(-0.1))


def test_regrets_are_kept_per_kind_and_forgotten_as_the_ring_wraps():
    t = tuner(capacity=4)
    # the six oldest of twelve equally valuable entries go into a ring of four: the first
    # two are forgotten
    t.evicted(candidates(range(12), [1] * 12), np.arange(6), KEYS[:6])
    assert not t.returned(Kind.PAGE, KEYS[:2])
    assert not t.returned(Kind.CHECKPOINT, KEYS[2:6])  # a page key is no checkpoint's
    assert t.returned(Kind.PAGE, KEYS[2:6]) == 4


def test_the_engine_tunes_alpha_from_prompts_stored_again_after_eviction():
    layout = Layout(16, paged=hybrid_layout().paged)
    config = EngineConfig(host=HostConfig(budget_bytes=12 * layout.page_bytes, pin=False),
                          policy=PolicyConfig(eviction="flop", alpha=1.0, tune_alpha=True))
    engine = Engine.open(config)
    worker = random_buffers(layout, seed=1)
    first = prompt_keys(layout, seed=1, pages=6)
    # 1. two prompts of 6 pages fill the host; a third of 4 pushes the 4 deepest pages of
    # the first out. They were older than half the host but worth as much as the rest:
    # recency alone condemned them
    engine.store_pages(worker, first, range(6))
    engine.store_pages(worker, prompt_keys(layout, seed=2, pages=6), range(6, 12))
    engine.store_pages(worker, prompt_keys(layout, seed=3, pages=4), range(12, 16))
    assert engine.stats().alpha == 1.0 and engine.stats().counters["evicted_host"] == 4
    # 2. the first prompt comes back: its 4 pages are regrets of recency, alpha grows
    engine.store_pages(worker, first, range(6))
    assert engine.stats().counters["regrets"] == 4
    assert engine.stats().alpha == pytest.approx(math.exp(0.1))
