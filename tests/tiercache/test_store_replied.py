"""Stores that reply once their copies are queued (a GPU worker's `done_event`, store.py):
their entries are published after the reply, yet every call that begins after it sees
them; a store whose publish fails after the reply leaves nothing behind; closing the
engine publishes (and flushes) what replied before.

On the CPU the copies are done before the reply anyway (CpuTransfer ignores the event),
so these tests hold the publishing thread back with a failpoint: the entries are still
unpublished when the next call begins. The events themselves, and a worker writing its
rows again right after the reply, are tested on a GPU (tests/gpu/test_gpu.py)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

from drills.worlds import hybrid_layout, page_bytes, prompt_keys, random_buffers, same, slot_bytes
from tiercache import failpoints
from tiercache.engine import Engine, EngineConfig
from tiercache.hashing import distinct_keys
from tiercache.invariants import violations
from tiercache.results import Tier
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig

pytestmark = pytest.mark.concurrent  # they look at the engine while a publish is held back

LAYOUT = hybrid_layout(page_rows=400, slot_rows=4)
PAGES = 300  # one part of the store's pipeline: every batch is published after the reply


def open_engine(tmp_path=None) -> Engine:
    disk = DiskConfig(str(tmp_path), map_size=1 << 27) if tmp_path else None
    return Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 27, pin=False), disk=disk))


class Held:
    """A failpoint action that holds every publish until `release`."""

    def __init__(self) -> None:
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self, name: str) -> None:
        self.reached.set()
        assert self.go.wait(10), "the test never released the publish"


def store_replied(engine, source, keys):
    """A store with a done event: its result, returned before its entries are published."""
    return engine.store(source, keys, range(PAGES), {PAGES: 1}, done_event=object())


@contextmanager
def replied_and_held(engine, source, keys, seconds: float = 0.2) -> Iterator[None]:
    """A store that replied, its publish held back for `seconds` from now."""
    held = Held()
    with failpoints.armed("store.before_publish", held):
        store_replied(engine, source, keys)
        assert held.reached.wait(10)
        threading.Timer(seconds, held.go.set).start()
        yield


def test_a_call_after_the_reply_sees_the_entries():
    engine, source = open_engine(), random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=PAGES)
    held = Held()
    with failpoints.armed("store.before_publish", held):
        result = store_replied(engine, source, keys)
        assert (result.stored, result.present, result.skipped) == (PAGES + 1, 0, 0)
        assert result.checkpoints == (PAGES,)
        assert held.reached.wait(10) and engine.books.storing()  # replied, not yet published
        seen = []
        matcher = threading.Thread(target=lambda: seen.append(engine.match(LAYOUT, keys)))
        matcher.start()
        matcher.join(0.3)
        assert matcher.is_alive()  # the match waits for the store that replied before it
        held.go.set()
        matcher.join(10)
    assert seen[0].pages == PAGES and seen[0].checkpoint_tier == Tier.HOST
    other = random_buffers(LAYOUT, seed=2)
    assert engine.load(other, keys, range(100, 100 + PAGES), slot=3).match.pages == PAGES
    assert same(page_bytes(other, range(100, 100 + PAGES)), page_bytes(source, range(PAGES)))
    assert same(slot_bytes(other, 3), slot_bytes(source, 1))
    assert violations(engine) == []
    engine.close()


def test_calls_after_a_reply_settle_it_before_they_act():
    """Evict, stats and a second store, each right after a store replied: the evict drops
    the entries, stats count them, the second store finds them present."""
    for call in ("evict", "stats", "store"):
        engine, source = open_engine(), random_buffers(LAYOUT, seed=3)
        keys = prompt_keys(LAYOUT, seed=3, pages=PAGES)
        with replied_and_held(engine, source, keys):
            if call == "evict":
                assert engine.evict(keys) == PAGES + 1
                assert engine.match(LAYOUT, keys).pages == 0
            elif call == "stats":
                host = next(t for t in engine.stats().tiers if t.tier == Tier.HOST)
                assert host.entries == PAGES + 1
            else:
                again = engine.store(source, keys, range(PAGES), {PAGES: 1})
                assert (again.stored, again.present) == (0, PAGES + 1)
        assert violations(engine) == []
        engine.close()


def test_a_store_held_back_holds_back_the_calls_of_its_own_scope_only():
    """The daemon's scope is the tenant: a store whose copies wait (here, its publish held)
    must not hold back another tenant's calls, nor a metrics scrape; its own tenant's
    calls still see its entries."""
    from tiercache.store import NO_SCOPE
    engine, source = open_engine(), random_buffers(LAYOUT, seed=8)
    keys, others = prompt_keys(LAYOUT, seed=8, pages=PAGES), prompt_keys(LAYOUT, seed=9, pages=20)
    assert engine.store(source, others, range(20), {20: 0}, scope="b").stored == 21
    held = Held()
    with failpoints.armed("store.before_publish", held):
        engine.store(source, keys, range(PAGES), {PAGES: 1}, done_event=object(), scope="a")
        assert held.reached.wait(10)
        started = time.monotonic()
        assert engine.match(LAYOUT, others, scope="b").pages == 20  # at once
        assert engine.load(random_buffers(LAYOUT, seed=10), others, range(20), slot=0,
                           scope="b").match.pages == 20
        assert engine.store(source, others, range(20), {20: 0}, scope="b").present == 21
        assert engine.evict(others, scope="b") == 21
        engine.stats(scope=NO_SCOPE)
        assert time.monotonic() - started < 5  # none of them waited for the held publish
        assert engine.books.storing()  # still held
        seen = []
        matcher = threading.Thread(target=lambda: seen.append(engine.match(LAYOUT, keys, scope="a")))
        matcher.start()
        matcher.join(0.3)
        assert matcher.is_alive()  # its own scope waits for it
        held.go.set()
        matcher.join(10)
    assert seen[0].pages == PAGES
    assert violations(engine) == []
    engine.close()


def test_a_publish_that_fails_after_the_reply_leaves_nothing_behind():
    engine, source = open_engine(), random_buffers(LAYOUT, seed=4)
    keys = prompt_keys(LAYOUT, seed=4, pages=PAGES)
    with failpoints.armed("store.before_publish", "raise"):
        result = store_replied(engine, source, keys)
        assert result.stored == PAGES + 1  # what the reply promised: its copies were queued
        match = engine.match(LAYOUT, keys)
    assert match.pages == 0 and match.kv_pages == 0
    assert engine.stats().counters["unpublished_stores"] == 1
    assert not engine.books.storing() and engine.host.used_bytes == 0  # claims and slots let go
    assert violations(engine) == []
    # the keys are free again: the same store, waited for, keeps everything
    assert engine.store(source, keys, range(PAGES), {PAGES: 1}).stored == PAGES + 1
    assert engine.match(LAYOUT, keys).pages == PAGES
    engine.close()


def test_close_publishes_and_flushes_the_stores_that_replied(tmp_path):
    engine, source = open_engine(tmp_path), random_buffers(LAYOUT, seed=5)
    keys = prompt_keys(LAYOUT, seed=5, pages=PAGES)
    with replied_and_held(engine, source, keys):
        engine.close()
    reopened = open_engine(tmp_path)
    assert reopened.match(LAYOUT, keys).pages == PAGES
    other = random_buffers(LAYOUT, seed=6)
    assert reopened.load(other, keys, range(PAGES), slot=0).match.pages == PAGES
    assert same(page_bytes(other, range(PAGES)), page_bytes(source, range(PAGES)))
    reopened.close()


def test_stores_that_replied_publish_in_order_without_another_call():
    """Many stores that replied, then nothing but time: the publishing thread publishes
    them all (the background then copies on as usual)."""
    engine, source = open_engine(), random_buffers(LAYOUT, seed=7)
    prompts = [prompt_keys(LAYOUT, seed=10 + n, pages=20) for n in range(12)]
    for n, keys in enumerate(prompts):
        engine.store(source, keys, range(20 * n, 20 * n + 20), done_event=object())
    for _ in range(500):  # no call into the engine meanwhile: each would settle them
        if not engine.books.storing():
            break
        time.sleep(0.01)
    assert all(engine.books.cached_pages(distinct_keys(keys)) == 20 for keys in prompts)
    assert violations(engine) == []
    engine.close()
