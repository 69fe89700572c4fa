"""Invariant 1 under injected failures: an entry is visible only once its bytes are whole.

Failures are injected at named points (tiercache.failpoints) between copying bytes and
publishing them, inside and after LMDB commits, while reading disk entries and before a
load writes the worker's rows. Every byte a load delivers is checked against the content
its key stands for (keyed.py): 0 wrong entries, whatever failed.
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import numpy as np
import pytest

from drills import keyed, prompts
from drills.publish import LAYOUT, PAGES, load_checked, loader, open_engine, stored, storer
from tests.service.daemon import running_daemon
from drills.worlds import random_buffers
from tiercache import failpoints
from tiercache.client import Client
from tiercache.engine import Engine, EngineConfig
from tiercache.errors import DeadlineExceeded, FailedPrecondition, ResourceExhausted
from tiercache.failpoints import InjectedFault
from tiercache.results import Tier
from tiercache.tiers.host import HostConfig

def test_a_store_failing_before_publish_leaves_nothing_visible_and_frees_its_slots(tmp_path):
    engine = open_engine(tmp_path)
    buffers, keys = stored(engine, seed=1)
    # 1. the bytes are in host slots when the store fails: nothing is published ...
    with failpoints.armed("store.before_publish", "raise"), pytest.raises(InjectedFault):
        engine.store(buffers, keys, range(PAGES), {PAGES: 0})
    assert engine.match(LAYOUT, keys).pages == 0 and len(engine.index) == 0
    # 2. ... and the slots it filled are free again
    assert engine.host.used_bytes == 0
    # 3. the same store without the failure is whole
    engine.store(buffers, keys, range(PAGES), {PAGES: 0})
    assert load_checked(engine, keys) == PAGES
    engine.close()


def test_entries_are_invisible_between_their_copy_and_their_publish(tmp_path):
    engine = open_engine(tmp_path)
    buffers, keys = stored(engine, seed=2)
    copied, release = threading.Event(), threading.Event()

    def hold(_name):
        copied.set()
        release.wait(10)
    with failpoints.armed("store.before_publish", hold):
        storing = threading.Thread(target=engine.store, args=(buffers, keys, range(PAGES), {PAGES: 0}))
        storing.start()
        assert copied.wait(10)
        # the pages' bytes are in host slots, not yet published: a match and a load miss
        assert engine.match(LAYOUT, keys).pages == 0
        assert load_checked(engine, keys) == 0
        release.set()
        storing.join()
    assert load_checked(engine, keys) == PAGES
    engine.close()


def test_a_failed_disk_commit_publishes_nothing_on_disk_and_a_durable_store_says_so(tmp_path):
    engine = open_engine(tmp_path)
    buffers, keys = stored(engine, seed=3)
    with failpoints.armed("disk.before_commit", "raise"):
        # 1. the durable acknowledgement is refused: the transaction was aborted
        with pytest.raises(ResourceExhausted, match="disk"):
            engine.store(buffers, keys, range(PAGES), {PAGES: 0}, durable=True, timeout=10)
    assert engine.stats().tiers[1].entries == 0
    # 2. without its host copies, the prompt is a miss, not garbage
    engine.evict(tier=Tier.HOST)
    assert load_checked(engine, keys) == 0
    engine.close(flush=False)


def test_entries_committed_but_not_yet_published_are_found_after_a_restart(tmp_path):
    engine = open_engine(tmp_path)
    buffers, keys = stored(engine, seed=4)
    with failpoints.armed("disk.after_commit", "raise"):
        engine.store(buffers, keys, range(PAGES), {PAGES: 0})
        with pytest.raises(InjectedFault):
            engine.drain()
    assert engine.stats().tiers[1].entries == 0  # committed, but the index never heard
    engine.close(flush=False)
    # a new engine indexes what LMDB committed, with its checksums: every byte as stored
    engine = open_engine(tmp_path)
    assert engine.stats().tiers[1].entries == PAGES + 1
    assert load_checked(engine, keys) == PAGES
    engine.close()


def test_a_disk_read_error_fails_the_load_as_a_whole_and_promotes_nothing(tmp_path):
    engine = open_engine(tmp_path)
    buffers, keys = stored(engine, seed=5)
    engine.store(buffers, keys, range(PAGES), {PAGES: 0})
    engine.drain()
    engine.evict(tier=Tier.HOST)
    # 1. the load reads disk entries into new host slots and fails half way
    with failpoints.armed("disk.read", "raise"), pytest.raises(InjectedFault):
        engine.load(random_buffers(LAYOUT, seed=9), keys, list(range(10, 14)), 5)
    # 2. no slot it was filling became a host entry; nothing stays pinned
    assert engine.stats().tiers[0].entries == 0 and engine.host.used_bytes == 0
    assert not engine.index.column("pins", engine.index.rows_in(Tier.DISK)).any()
    # 3. the next load reads them whole
    assert load_checked(engine, keys) == PAGES
    engine.close()


def test_a_load_failing_before_it_writes_the_rows_unpins_its_entries(tmp_path):
    engine = open_engine(tmp_path)
    buffers, keys = stored(engine, seed=6)
    engine.store(buffers, keys, range(PAGES), {PAGES: 0})
    with failpoints.armed("load.before_scatter", "raise"), pytest.raises(InjectedFault):
        engine.load(random_buffers(LAYOUT, seed=9), keys, list(range(10, 14)), 5)
    engine.drain()  # the disk writer pins what it writes: let it finish
    assert engine.evict(tier=Tier.HOST) == PAGES + 1  # the load left nothing pinned
    engine.close()


def test_stores_and_loads_under_random_failures_never_see_an_incomplete_entry(tmp_path):
    # a host of 12 pages for 24 prompts of 5 entries: constant eviction, disk reads
    engine = open_engine(tmp_path, host_pages=12, writes="back")
    seeds, stop, errors, loaded = list(range(100, 124)), threading.Event(), [], []
    points = {"store.before_publish": "raise(0.2)", "disk.before_commit": "raise(0.2)",
              "disk.read": "raise(0.05)", "load.before_scatter": "raise(0.05)"}
    threads = [threading.Thread(target=storer, args=(engine, seeds, stop, errors)) for _ in range(2)]
    threads += [threading.Thread(target=loader, args=(engine, seeds, stop, errors, loaded))
                for _ in range(2)]
    with ExitStack() as armed:
        for name, action in points.items():
            armed.enter_context(failpoints.armed(name, action))
        for thread in threads:
            thread.start()
        time.sleep(3)
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
    assert sum(pages > 0 for pages in loaded) > 10  # the drill hit, and every hit was exact
    # once the background writer is done, nothing is pinned and the host's books balance
    for _ in range(2):  # the first barrier may re-raise a failure injected meanwhile
        try:
            engine.drain()
        except InjectedFault:
            pass
    rows = engine.index.rows_in(Tier.HOST)
    assert not engine.index.column("pins", rows).any()
    assert engine.host.used_bytes == int(engine.index.column("nbytes", rows).sum())
    engine.close(flush=False)


def test_keyed_content_tells_entries_apart():
    # the oracle itself: two keys never give the same bytes, one key always does
    a, b = (bytes([n]) * 16 for n in (1, 2))
    assert np.array_equal(keyed.content(a, keyed.PAGE, 64), keyed.content(a, keyed.PAGE, 64))
    assert not np.array_equal(keyed.content(a, keyed.PAGE, 64), keyed.content(b, keyed.PAGE, 64))


def test_two_loads_promoting_at_once_both_finish(tmp_path):
    # regression: finishing one promotion while another was in flight compared their row
    # arrays (dataclass equality), raised, and left both loads' entries pinned for good
    engine = open_engine(tmp_path)
    prompts = [stored(engine, seed) for seed in (7, 8)]
    for buffers, keys in prompts:
        engine.store(buffers, keys, range(PAGES), {PAGES: 0})
    engine.drain()
    engine.evict(tier=Tier.HOST)
    reading, release = threading.Event(), threading.Event()

    def hold_first_load(_name):
        if threading.current_thread().name == "first":
            reading.set()
            release.wait(10)
    with failpoints.armed("disk.read", hold_first_load):
        first = threading.Thread(target=load_checked, args=(engine, prompts[0][1]), name="first")
        first.start()
        assert reading.wait(10)  # the first load's promotion is in flight ...
        assert load_checked(engine, prompts[1][1], rows=range(20, 20 + PAGES), slot=6) == PAGES
        release.set()  # ... and the second one finished before it
        first.join(10)
    assert not first.is_alive()
    assert not engine.index.column("pins", engine.index.rows_in(Tier.DISK)).any()
    engine.close()


def test_a_store_whose_caller_stopped_waiting_publishes_nothing(tmp_path, monkeypatch):
    # a worker whose store passed its deadline may write its rows again at once: the
    # daemon, still about to copy them, must not publish what it then reads
    monkeypatch.setenv("TIERCACHE_FAILPOINTS", "store.before_gather=sleep(0.6)")
    with running_daemon(tmp_path, "--no-disk") as (address, _):
        worker = Client(address, timeout=0.2).register(prompts.MODEL, prompts.LAYOUT)
        paged, slots = keyed.byte_rows(worker.paged), keyed.byte_rows(worker.slots)
        tokens = prompts.tokens(7)
        keyed.fill(paged, slots, worker.keys(tokens), list(range(prompts.PAGES)), 0)
        with pytest.raises(DeadlineExceeded):
            worker.store(tokens, kv_rows=range(prompts.PAGES),
                         checkpoints={prompts.PAGES * prompts.PAGE: 0})
        keyed.poison(paged), keyed.poison(slots)  # the worker reuses its rows at once
        time.sleep(1.5)  # the daemon wakes, copies the rows, finds the caller gone
        patient = Client(address, timeout=10).register(prompts.MODEL, prompts.LAYOUT)
        assert patient.match(tokens).pages == 0
        worker.close(), patient.close()


def test_a_durable_store_holds_its_entries_until_they_are_on_disk(tmp_path):
    engine = open_engine(tmp_path, writes="back")
    buffers, keys = stored(engine, seed=7)
    evicted = []

    def evict(name):  # other stores' evictions, between publishing and committing
        evicted.extend([engine.evict(keys), engine.evict(tier=Tier.HOST)])
    with failpoints.armed("store.before_persist", evict):
        result = engine.store(buffers, keys, range(PAGES), {PAGES: 0}, durable=True, timeout=10)
    # 1. nothing could be evicted meanwhile, and all of it is on disk, unpinned again
    assert evicted == [0, 0] and result.checkpoints == (PAGES,)
    assert engine.stats().tiers[1].entries == PAGES + 1
    assert not engine.index.column("pins", engine.index.rows_in(Tier.HOST)).any()
    # 2. from disk alone, every byte as stored
    engine.evict(tier=Tier.HOST)
    assert load_checked(engine, keys) == PAGES
    engine.close()


def test_a_durable_store_stores_again_what_a_failed_concurrent_store_was_writing(tmp_path):
    engine = open_engine(tmp_path, writes="back")
    buffers, keys = stored(engine, seed=8)
    writing, durable_waits = threading.Event(), threading.Event()

    def other_store_fails(name):  # only the other store's thread stops here
        if threading.current_thread().name == "other":
            writing.set()
            assert durable_waits.wait(10)
            raise InjectedFault(name)

    def persist_point(name):
        durable_waits.set()  # the durable store found pages the other store was writing

    def other():
        with pytest.raises(InjectedFault):
            engine.store(buffers, keys, range(PAGES), {PAGES: 0})
    with failpoints.armed("store.before_publish", other_store_fails), \
            failpoints.armed("store.before_persist", persist_point):
        thread = threading.Thread(target=other, name="other")
        thread.start()
        assert writing.wait(10)  # 1. the other store claimed the pages, then stalls
        # 2. the durable store skips what the other is writing, waits, then stores it itself
        result = engine.store(buffers, keys, range(PAGES), {PAGES: 0}, durable=True, timeout=10)
        thread.join()
    assert result.checkpoints == (PAGES,)
    assert engine.stats().tiers[1].entries == PAGES + 1
    engine.evict(tier=Tier.HOST)
    assert load_checked(engine, keys) == PAGES
    engine.close()


def test_a_durable_store_without_a_disk_tier_is_refused_before_it_copies_anything():
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=100 * LAYOUT.page_bytes, pin=False)))
    buffers, keys = stored(engine, seed=9)
    with pytest.raises(FailedPrecondition, match="disk tier"):
        engine.store(buffers, keys, range(PAGES), {PAGES: 0}, durable=True)
    assert engine.stats().tiers[0].entries == 0
    engine.close()


def test_a_load_whose_caller_stopped_waiting_writes_nothing_into_its_rows(tmp_path, monkeypatch):
    # a worker whose load passed its deadline recomputes into the same rows at once: the
    # daemon, still about to copy into them, must not write them any more
    monkeypatch.setenv("TIERCACHE_FAILPOINTS", "load.before_scatter=sleep(0.6)")
    with running_daemon(tmp_path, "--no-disk") as (address, _):
        patient = Client(address, timeout=10).register(prompts.MODEL, prompts.LAYOUT)
        tokens = prompts.tokens(8)
        paged, slots = keyed.byte_rows(patient.paged), keyed.byte_rows(patient.slots)
        keyed.fill(paged, slots, patient.keys(tokens), list(range(prompts.PAGES)), 0)
        assert patient.store(tokens, kv_rows=range(prompts.PAGES),
                             checkpoints={prompts.PAGES * prompts.PAGE: 0}).stored == prompts.PAGES + 1
        worker = Client(address, timeout=0.2).register(prompts.MODEL, prompts.LAYOUT)
        with pytest.raises(DeadlineExceeded):
            worker.load(tokens, kv_rows=range(prompts.PAGES), slot=1)
        rows = keyed.byte_rows(worker.paged) + keyed.byte_rows(worker.slots)
        keyed.poison(rows)  # the worker's own writes, right after the failure
        time.sleep(1.5)  # the daemon wakes before its copies, finds the caller gone
        assert all(bool((r == 0xA5).all()) for r in rows)
        assert patient.load(tokens, kv_rows=range(prompts.PAGES), slot=1).match.pages == prompts.PAGES
        worker.close(), patient.close()
