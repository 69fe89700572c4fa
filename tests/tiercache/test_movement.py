"""Write policies (host -> disk in the background) and promotions (disk -> host) racing loads."""

import threading

import numpy as np
import pytest

from tiercache.engine import Engine, EngineConfig
from tiercache.invariants import violations
from tiercache.results import Kind, Tier
from tiercache.layout import Layout
from tiercache.policy import PolicyConfig, WriteConfig
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig
from drills.worlds import (hybrid_layout, page_bytes, prompt_keys, random_buffers, same,
                                     slot_bytes)

LAYOUT = hybrid_layout(page_rows=64, slot_rows=8)
PAGES = Layout(16, paged=LAYOUT.paged)  # attention only: every cached page prefix is a hit


def open_engine(tmp_path, host_pages=1000, layout=LAYOUT, **writes):
    config = EngineConfig(host=HostConfig(budget_bytes=host_pages * layout.page_bytes, pin=False),
                          disk=DiskConfig(str(tmp_path), map_size=1 << 26, sync=False),
                          policy=PolicyConfig(writes=WriteConfig(**writes)))
    return Engine.open(config)


def on_disk(engine, keys, kind=Kind.PAGE):
    rows = engine.index.rows_of(kind, np.frombuffer(b"".join(keys), np.uint64).reshape(-1, 2))
    return (rows >= 0) & engine.index.in_tier(np.maximum(rows, 0), Tier.DISK)


def test_write_through_puts_every_store_on_disk_by_the_next_barrier(tmp_path):
    engine = open_engine(tmp_path, host="through")
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=5)
    # 1. a store of 5 pages and the checkpoint at their end returns at once ...
    engine.store(worker, keys, range(5), {5: 0})
    # 2. ... and after the barrier all six are on disk as well, written in the background
    engine.drain()
    assert [t.entries for t in engine.stats().tiers] == [6, 6]
    assert engine.stats().counters["disk_writes"] == 6 and engine.stats().counters["demoted"] == 0
    # 3. without their host copies they still load exactly
    assert engine.evict(tier=Tier.HOST) == 6
    other = random_buffers(LAYOUT, seed=2)
    result = engine.load(other, keys, range(10, 15), slot=3)
    assert set(result.bytes_from) == {Tier.DISK}
    assert same(page_bytes(other, range(10, 15)), page_bytes(worker, range(5)))
    assert same(slot_bytes(other, 3), slot_bytes(worker, 0))
    engine.close()


def test_write_through_batches_entries_into_transactions(tmp_path):
    engine = open_engine(tmp_path, host="through", batch_entries=4)
    batches = []
    write = engine.disk.write
    engine.disk.write = lambda entries, checks: (batches.append(len(entries)), write(entries, checks))
    # ten pages stored at once go to disk in transactions of at most 4
    keys = prompt_keys(LAYOUT, seed=1, pages=10)
    engine.store_pages(random_buffers(LAYOUT, seed=1), keys, range(10))
    engine.drain()
    assert batches == [4, 4, 2]
    engine.close()


def test_write_back_writes_the_coldest_entries_only_once_the_host_nears_full(tmp_path):
    engine = open_engine(tmp_path, host_pages=20, layout=PAGES, host="back", clean_ahead=0.25)
    worker = random_buffers(PAGES, seed=1)
    older, newer = prompt_keys(PAGES, seed=1, pages=10), prompt_keys(PAGES, seed=2, pages=6)
    # 1. half the host in use: nothing is written
    engine.store_pages(worker, older, range(10))
    engine.drain()
    assert engine.stats().tiers[1].entries == 0
    # 2. 16 of 20 pages in use, past 75%: the coldest quarter (5 pages) is written ahead of
    # eviction, the leaves of the older prompt
    engine.store_pages(worker, newer, range(10, 16))
    engine.drain()
    assert on_disk(engine, older).tolist() == [False] * 5 + [True] * 5
    assert not on_disk(engine, newer).any()
    engine.close()


def test_a_victim_the_writer_has_not_reached_is_written_by_the_eviction(tmp_path):
    # write-back with nothing written ahead: every eviction finds its victims dirty
    engine = open_engine(tmp_path, host_pages=10, layout=PAGES, host="back", clean_ahead=0.0)
    worker = random_buffers(PAGES, seed=1)
    first = prompt_keys(PAGES, seed=1, pages=10)
    engine.store_pages(worker, first, range(10))
    # a second prompt needs 4 slots: the 4 deepest pages of the first move to disk first
    engine.store_pages(worker, prompt_keys(PAGES, seed=2, pages=4), range(10, 14))
    counters = engine.stats().counters
    assert (counters["demoted"], counters["evicted_host"], counters["disk_writes"]) == (4, 4, 0)
    # no entry was lost: the first prompt still matches in full, its tail from disk
    match = engine.match(PAGES, first)
    assert match.pages == 10 and match.page_tiers == (Tier.HOST,) * 6 + (Tier.DISK,) * 4
    engine.close()


def test_a_host_entry_is_in_one_disk_batch_at_a_time(tmp_path):
    # an eviction's write and the background writer may reach the same dirty rows: the
    # second batch leaves the rows the first took (both publishing them in DISK raced in CI)
    engine = open_engine(tmp_path, layout=PAGES, host="back", clean_ahead=0.0)
    keys = prompt_keys(PAGES, seed=1, pages=6)
    engine.store_pages(random_buffers(PAGES, seed=1), keys, range(6))
    rows = engine.index.rows_of(Kind.PAGE, np.frombuffer(b"".join(keys), np.uint64).reshape(-1, 2))
    first, _ = engine.books.begin_write(rows[:4], 4)
    second, _ = engine.books.begin_write(rows, 6)
    assert sorted(first.rows.tolist()) == sorted(rows[:4].tolist())
    assert sorted(second.rows.tolist()) == sorted(rows[4:].tolist())
    assert engine.books.begin_write(rows, 6)[0] is None  # every row is taken
    for batch in (first, second):
        engine.books.end_write(batch, engine.mover.write(batch))
    assert on_disk(engine, keys).all()
    engine.close()


@pytest.mark.concurrent  # stalls the background thread mid-work
def test_a_disk_write_publishes_after_its_commit_and_pins_what_it_reads(tmp_path):
    engine = open_engine(tmp_path, host="through")
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=3)
    writing, release = threading.Event(), threading.Event()
    write = engine.disk.write

    def slow_write(entries, checks):
        writing.set()
        release.wait(10)
        write(entries, checks)
    engine.disk.write = slow_write
    engine.store_pages(worker, keys, range(3))
    assert writing.wait(10)
    # 1. mid-transaction: nothing is visible in the disk tier yet
    assert engine.stats().tiers[1].entries == 0 and not on_disk(engine, keys).any()
    # 2. the entries being written are pinned: an explicit eviction leaves them in the host
    assert engine.evict(tier=Tier.HOST) == 0
    # 3. after the commit they are on disk and may leave the host
    release.set()
    engine.drain()
    assert on_disk(engine, keys).all()
    assert engine.evict(tier=Tier.HOST) == 3
    engine.close()


@pytest.mark.concurrent  # stalls the background thread mid-work
def test_a_failed_disk_write_surfaces_at_the_barrier_and_leaves_entries_in_the_host(tmp_path):
    engine = open_engine(tmp_path, host="through")
    keys = prompt_keys(LAYOUT, seed=1, pages=2)

    def broken(entries, checks):
        raise OSError("disk gone")
    engine.disk.write = broken
    engine.store_pages(random_buffers(LAYOUT, seed=1), keys, range(2))
    with pytest.raises(OSError, match="disk gone"):
        engine.drain()
    # nothing reached the disk tier, nothing stays pinned
    assert [t.entries for t in engine.stats().tiers] == [2, 0]
    assert engine.evict(tier=Tier.HOST) == 2
    engine.close(flush=False)


@pytest.mark.parametrize("flush, expected", [(True, 3), (False, 0)])
def test_close_flushes_what_the_host_acknowledged_and_joins_the_thread(tmp_path, flush, expected):
    engine = open_engine(tmp_path, host="back")
    keys = prompt_keys(LAYOUT, seed=1, pages=2)
    engine.store(random_buffers(LAYOUT, seed=1), keys, range(2), {2: 0})
    assert engine.background.running
    engine.close(flush=flush)
    assert not engine.background.running
    # a new engine on the same directory sees what was flushed
    reopened = open_engine(tmp_path)
    assert reopened.stats().tiers[1].entries == expected
    reopened.close()


def flushed_to_disk_only(tmp_path, pages=6):
    """An engine whose only copy of a 6-page prompt and its checkpoint is on disk."""
    engine = open_engine(tmp_path)
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=pages)
    engine.store(worker, keys, range(pages), {pages: 0})
    engine.flush()
    assert engine.evict(tier=Tier.HOST) == pages + 1
    return engine, worker, keys


def test_a_match_can_start_promoting_its_disk_hit(tmp_path):
    engine, _, keys = flushed_to_disk_only(tmp_path)
    # 1. the match answers from the index at once and queues the promotion
    match = engine.match(LAYOUT, keys, prefetch=True)
    assert match.page_tiers == (Tier.DISK,) * 6
    # 2. once the background thread is done, the hit lives in the host
    engine.drain()
    match = engine.match(LAYOUT, keys)
    assert match.page_tiers == (Tier.HOST,) * 6 and match.checkpoint_tier == Tier.HOST
    counters = engine.stats().counters
    assert (counters["prefetches"], counters["promoted"]) == (7, 7)
    # 3. nothing is left to promote
    assert engine.prefetch(LAYOUT, keys, wait=False) == 0
    engine.close()


def slow_copies(engine, thread_name):
    """Make disk reads on `thread_name` write zeros into their targets (a torn copy), then
    stop until released, then copy for real. Returns (copying, release) events."""
    copying, release = threading.Event(), threading.Event()
    read = engine.mover.read

    def slow(kind, rows, keys, targets):
        if threading.current_thread().name == thread_name:
            for target in targets:
                target.zero_()
            copying.set()
            release.wait(10)
        return read(kind, rows, keys, targets)
    engine.mover.read = slow
    return copying, release


def wait_hook(engine):
    """An event set when a load starts waiting for promotions."""
    waiting = threading.Event()
    await_moves = engine.promotions.await_moves

    def hooked(rows):
        waiting.set()
        await_moves(rows)
    engine.promotions.await_moves = hooked
    return waiting


def start_load(engine, worker, keys, results):
    """A thread loading the 6-page prompt `keys` into rows 30..35 and slot 3 of `worker`."""
    loader = threading.Thread(target=lambda: results.append(
        engine.load(worker, keys, range(30, 36), slot=3)))
    loader.start()
    return loader


@pytest.mark.concurrent  # stalls the background thread mid-work
def test_a_load_waits_for_a_promotion_in_flight_and_never_reads_torn_bytes(tmp_path):
    engine, worker, keys = flushed_to_disk_only(tmp_path)
    copying, release = slow_copies(engine, "tiercache-background")
    # 1. a match starts the promotion; its copy is half done (zeros) and stalls
    engine.match(LAYOUT, keys, prefetch=True)
    assert copying.wait(10)
    # 2. a load of the same prompt starts and waits for it: nothing lands in its rows
    other = random_buffers(LAYOUT, seed=2)
    before = page_bytes(other, range(30, 36))
    waiting, results = wait_hook(engine), []
    loader = start_load(engine, other, keys, results)
    assert waiting.wait(10)
    assert same(page_bytes(other, range(30, 36)), before)
    # 3. the copy completes and is published; the load reads the promoted host copies
    release.set()
    loader.join(10)
    assert results[0].bytes_from == {Tier.HOST: 6 * LAYOUT.page_bytes + LAYOUT.checkpoint_bytes}
    assert same(page_bytes(other, range(30, 36)), page_bytes(worker, range(6)))
    assert same(slot_bytes(other, 3), slot_bytes(worker, 0))
    counters = engine.stats().counters
    assert (counters["promoted"], counters["promotion_waits"]) == (7, 1)
    engine.close()


@pytest.mark.concurrent  # stalls the background thread mid-work
def test_two_loads_of_one_disk_hit_promote_it_once(tmp_path):
    engine, worker, keys = flushed_to_disk_only(tmp_path)
    copying, release = slow_copies(engine, "first")
    readers = [random_buffers(LAYOUT, seed=s) for s in (2, 3)]
    results = {}

    def load(name, reader):
        results[name] = engine.load(reader, keys, range(30, 36), slot=3)
    # 1. the first load promotes the hit and stalls mid-copy
    first = threading.Thread(target=load, args=("first", readers[0]), name="first")
    first.start()
    assert copying.wait(10)
    # 2. the second load waits for that promotion instead of starting its own
    waiting = wait_hook(engine)
    second = threading.Thread(target=load, args=("second", readers[1]), name="second")
    second.start()
    assert waiting.wait(10)
    release.set()
    first.join(10)
    second.join(10)
    # 3. the first read from disk, the second from the host copy the first published
    assert set(results["first"].bytes_from) == {Tier.DISK}
    assert set(results["second"].bytes_from) == {Tier.HOST}
    for reader in readers:
        assert same(page_bytes(reader, range(30, 36)), page_bytes(worker, range(6)))
    assert engine.stats().counters["promoted"] == 7
    engine.close()


def test_a_load_that_finds_a_promotion_started_after_its_wait_reads_the_disk_itself(tmp_path):
    engine, worker, keys = flushed_to_disk_only(tmp_path)
    copying, release = slow_copies(engine, "tiercache-background")
    waited, go_on = threading.Event(), threading.Event()
    await_moves = engine.promotions.await_moves

    def then_pause(rows):
        await_moves(rows)
        waited.set()
        go_on.wait(10)
    engine.promotions.await_moves = then_pause
    other, results = random_buffers(LAYOUT, seed=2), []
    # 1. a load finds nothing moving and goes on ...
    loader = start_load(engine, other, keys, results)
    assert waited.wait(10)
    # 2. ... while a match starts promoting the same entries, which stalls half copied
    engine.match(LAYOUT, keys, prefetch=True)
    assert copying.wait(10)
    # 3. the load leaves the half-promoted copies alone and reads the disk itself
    go_on.set()
    loader.join(10)
    assert set(results[0].bytes_from) == {Tier.DISK}
    assert same(page_bytes(other, range(30, 36)), page_bytes(worker, range(6)))
    assert same(slot_bytes(other, 3), slot_bytes(worker, 0))
    # 4. the promotion finishes on its own; only it published host copies
    release.set()
    engine.drain()
    assert engine.stats().counters["promoted"] == 7
    assert engine.match(LAYOUT, keys).page_tiers == (Tier.HOST,) * 6
    engine.close()


@pytest.mark.concurrent  # holds a load between its copies and publishing its promotions
def test_a_load_holds_its_entries_until_it_has_published_what_it_promoted(tmp_path):
    # regression: a load unpinned its hit before publishing the host slots it promoted the
    # hit's disk entries into; an eviction meanwhile freed the rows, a store took them for
    # other keys, and the promoted slots were published onto those rows (or onto free ones):
    # slots the host arena never got back
    engine, worker, keys = flushed_to_disk_only(tmp_path)
    finishing, release = threading.Event(), threading.Event()
    finish = engine.promotions.finish

    def pause(move, placed, complete):
        finishing.set()
        release.wait(10)
        return finish(move, placed, complete)
    engine.promotions.finish = pause
    reader, results = random_buffers(LAYOUT, seed=2), []
    loader = start_load(engine, reader, keys, results)
    assert finishing.wait(10)  # 1. the load read the hit into host slots, not published yet
    # 2. another caller evicts the prompt, and a store of another one takes free rows
    assert engine.evict(keys) == 0  # the load still holds every entry
    other = prompt_keys(LAYOUT, seed=3, pages=6)
    engine.store(random_buffers(LAYOUT, seed=3), other, range(6), {6: 0})
    release.set()
    loader.join(10)
    # 3. the load published its promotions onto its own rows; the books balance
    assert set(results[0].bytes_from) == {Tier.DISK}
    assert same(page_bytes(reader, range(30, 36)), page_bytes(worker, range(6)))
    assert engine.match(LAYOUT, keys).page_tiers == (Tier.HOST,) * 6
    assert violations(engine) == []
    engine.close()
