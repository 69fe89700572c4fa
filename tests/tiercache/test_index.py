import numpy as np
import pytest

from tiercache.hashing import Namespace, key_array, page_keys
from tiercache.index import Index
from tiercache.results import Kind, StopReason, Tier

KEYS = key_array(page_keys(list(range(16 * 6)), Namespace("m", "fp").root(), 16))  # k1..k6


def stored(pages=(), checkpoints=(), tier=Tier.HOST):
    """An index holding pages k_n for n in `pages` and checkpoints at k_n for n in `checkpoints`."""
    index = Index(capacity=2)  # tiny, so the table has to grow
    pages, checkpoints = list(pages), list(checkpoints)
    slots = tier in (Tier.HOST, Tier.DEVICE)
    index.publish(Kind.PAGE, KEYS[[n - 1 for n in pages]], pages, 100, tier,
                  slots=range(len(pages)) if slots else None)
    index.publish(Kind.CHECKPOINT, KEYS[[n - 1 for n in checkpoints]], checkpoints, 999, tier,
                  slots=range(100, 100 + len(checkpoints)) if slots else None)
    return index


def hybrid_match(index, keys=KEYS):
    return index.match(keys, 16, page_bytes=100, checkpoint_bytes=999).match


def test_empty_cache_misses_at_the_first_page():
    match = hybrid_match(Index())
    assert (match.pages, match.tokens, match.prompt_pages) == (0, 0, 6)
    assert match.stop == StopReason.MISSING_PAGE and match.checkpoint_tier is None


def test_kv_without_a_checkpoint_is_no_hit_for_a_hybrid_layout():
    # all six KV pages are cached, but no recurrent state anywhere
    match = hybrid_match(stored(pages=range(1, 7)))
    assert match.pages == 0 and match.stop == StopReason.NO_CHECKPOINT
    assert match.page_tiers == ()  # no half hit: no KV pages reported without a state


def test_checkpoint_with_a_kv_page_missing_in_the_middle():
    # pages 1, 2, 4, 5, 6 cached (3 missing), checkpoints at 2 and 5
    match = hybrid_match(stored(pages=[1, 2, 4, 5, 6], checkpoints=[2, 5]))
    # the KV walk stops at page 3; the checkpoint at 5 is unreachable, the one at 2 is used
    assert match.pages == 2 and match.tokens == 32
    assert match.stop == StopReason.MISSING_PAGE
    assert match.page_tiers == (Tier.HOST, Tier.HOST) and match.checkpoint_tier == Tier.HOST


def test_checkpoint_beyond_the_kv():
    # pages 1..3 cached, checkpoints at 1 and 5
    match = hybrid_match(stored(pages=[1, 2, 3], checkpoints=[1, 5]))
    # pages go on to 3 but the only checkpoint at or before 3 is at 1
    assert match.pages == 1 and match.stop == StopReason.NO_CHECKPOINT


def test_the_branch_point_is_how_far_the_kv_pages_go():
    # pages 1..5 cached, a checkpoint at 2 only: the hit is 2 pages, the KV walk reaches 5
    match = hybrid_match(stored(pages=range(1, 6), checkpoints=[2]))
    assert (match.pages, match.kv_pages, match.stop) == (2, 5, StopReason.NO_CHECKPOINT)
    # nothing cached: both 0; KV without any checkpoint: no hit, but the pages count
    assert hybrid_match(Index()).kv_pages == 0
    assert hybrid_match(stored(pages=[1, 2, 3])).kv_pages == 3
    # the wire carries it both ways
    from tiercache.wire import match_from_proto, match_to_proto
    assert match_from_proto(match_to_proto(match)) == match


def test_full_hybrid_hit_ends_at_the_end_of_the_prompt():
    match = hybrid_match(stored(pages=range(1, 7), checkpoints=[3, 6]))
    assert match.pages == 6 and match.stop == StopReason.END_OF_PROMPT


def test_attention_only_layout_needs_no_checkpoint():
    index = stored(pages=[1, 2, 3, 5])
    match = index.match(KEYS, 16, page_bytes=100, checkpoint_bytes=0).match
    # pages 1..3 hit, page 4 is missing
    assert match.pages == 3 and match.stop == StopReason.MISSING_PAGE and match.checkpoint_tier is None


def test_ssm_only_layout_takes_the_deepest_checkpoint():
    index = stored(checkpoints=[2, 4])
    match = index.match(KEYS, 16, page_bytes=0, checkpoint_bytes=999).match
    # no KV pages needed: the state at page 4 is the hit, page_tiers stay empty
    assert match.pages == 4 and match.page_tiers == () and match.checkpoint_tier == Tier.HOST
    assert match.stop == StopReason.NO_CHECKPOINT
    full = index.match(KEYS[:4], 16, page_bytes=0, checkpoint_bytes=999).match
    assert full.pages == 4 and full.stop == StopReason.END_OF_PROMPT


def test_best_tier_is_reported_per_page():
    index = stored(pages=[1, 2], checkpoints=[2], tier=Tier.DISK)
    index.publish(Kind.PAGE, KEYS[:1], [1], 100, Tier.HOST, slots=[7])  # page 1 also in host
    match = hybrid_match(index, KEYS[:2])
    assert match.page_tiers == (Tier.HOST, Tier.DISK) and match.checkpoint_tier == Tier.DISK


def test_unpublish_removes_an_entry_left_in_no_tier():
    index = stored(pages=[1], tier=Tier.HOST)
    row = index.rows_of(Kind.PAGE, KEYS[:1])
    index.add_tier(row, Tier.DISK)
    index.unpublish(row, Tier.HOST)
    assert list(index.column("tiers", row)) == [Tier.DISK] and index.count[Tier.HOST] == 0
    index.unpublish(row, Tier.DISK)
    assert list(index.rows_of(Kind.PAGE, KEYS[:1])) == [-1] and len(index) == 0


def test_pinned_rows_are_not_eviction_candidates_and_cannot_be_unpublished():
    index = stored(pages=[1, 2, 3])
    rows = index.rows_of(Kind.PAGE, KEYS[:2])
    index.pin(rows)
    assert list(index.candidates(Tier.HOST).rows) == list(index.rows_of(Kind.PAGE, KEYS[2:3]))
    with pytest.raises(AssertionError, match="pinned"):
        index.unpublish(rows[:1], Tier.HOST)
    index.unpin(rows)
    assert len(index.candidates(Tier.HOST).rows) == 3


def test_publishing_twice_in_a_tier_or_with_another_size_is_a_bug():
    index = stored(pages=[1])
    with pytest.raises(ValueError, match="already published"):
        index.publish(Kind.PAGE, KEYS[:1], [1], 100, Tier.HOST, slots=[3])
    with pytest.raises(ValueError, match="bytes"):
        index.publish(Kind.PAGE, KEYS[:1], [1], 101, Tier.DISK)


def test_entries_of_another_size_are_misses_never_reads():
    # pages of 100 bytes and checkpoints of 999 bytes are cached under k1..k3
    index = stored(pages=[1, 2, 3], checkpoints=[3])
    # a caller whose pages are 400 bytes finds nothing: those entries are not its bytes
    other = index.match(KEYS, 16, page_bytes=400, checkpoint_bytes=999).match
    assert other.pages == 0 and other.stop == StopReason.MISSING_PAGE
    # nor one whose checkpoints have another size: the KV pages go on, the state does not
    other = index.match(KEYS, 16, page_bytes=100, checkpoint_bytes=4).match
    assert other.pages == 0 and other.stop == StopReason.NO_CHECKPOINT
    assert index.foreign == 4  # three pages, then the checkpoint at 3
    assert hybrid_match(index).pages == 3  # the entries' own size still hits


def test_a_key_repeated_in_one_publish_is_refused_and_changes_nothing():
    index = Index()
    keys = KEYS[[0, 1, 0]]
    with pytest.raises(ValueError, match="repeats"):
        index.publish(Kind.PAGE, keys, [1, 2, 1], 100, Tier.HOST, slots=[0, 1, 2])
    assert len(index) == 0 and index.count[Tier.HOST] == 0
    assert list(index.rows_of(Kind.PAGE, KEYS[:2])) == [-1, -1]
    # the same keys once each publish as usual
    rows = index.publish(Kind.PAGE, KEYS[:2], [1, 2], 100, Tier.HOST, slots=[0, 1])
    assert list(index.rows_of(Kind.PAGE, KEYS[:2])) == list(rows)


def test_a_caller_that_cannot_read_a_tier_misses_what_is_only_there():
    # a worker away from the device tier's GPU reads device entries from their host
    # copies: pages 1-2 and the checkpoint at 2 are in the host, pages 3-4 and the
    # checkpoint at 4 only on the device
    index = stored(pages=[1, 2], checkpoints=[2])
    index.publish(Kind.PAGE, KEYS[2:4], [3, 4], 100, Tier.DEVICE, slots=[5, 6])
    index.publish(Kind.CHECKPOINT, KEYS[3:4], [4], 999, Tier.DEVICE, slots=[105])
    index.publish(Kind.PAGE, KEYS[:1], [1], 100, Tier.DEVICE, slots=[7])  # page 1 in both
    keys = KEYS[:4]
    everywhere = index.match(keys, 16, page_bytes=100, checkpoint_bytes=999).match
    assert everywhere.pages == 4 and everywhere.checkpoint_tier == Tier.DEVICE
    away = index.match(keys, 16, page_bytes=100, checkpoint_bytes=999,
                       readable=Tier.HOST | Tier.DISK).match
    assert away.pages == 2 and away.stop == StopReason.MISSING_PAGE
    assert away.page_tiers == (Tier.HOST, Tier.HOST) and away.checkpoint_tier == Tier.HOST
    # the checkpoint alone only on the device: the hit stops at the one below it
    index.publish(Kind.PAGE, KEYS[2:4], [3, 4], 100, Tier.HOST, slots=[8, 9])
    away = index.match(keys, 16, page_bytes=100, checkpoint_bytes=999,
                       readable=Tier.HOST | Tier.DISK).match
    assert away.pages == 2 and away.stop == StopReason.NO_CHECKPOINT


def test_usable_and_locate_agree_with_their_definitions_on_random_columns():
    # the C loops (tiercache/_index.c) against the rules written out in numpy
    rng = np.random.default_rng(7)
    for _ in range(50):
        index = Index(capacity=64)
        cols = index._cols
        cols["tiers"][:] = rng.integers(0, 8, 64)
        cols["nbytes"][:] = rng.choice([100, 200], 64)
        cols["check"][:] = rng.choice([0, 5, 6], 64)
        cols["slot_1"][:], cols["slot_2"][:] = rng.integers(0, 1000, (2, 64))
        rows = rng.integers(-1, 64, rng.integers(0, 40))
        checks = rng.choice([5, 6], len(rows)).astype(np.uint64) if rng.random() < 0.5 else None
        readable = int(rng.integers(1, 8))
        at, looked = np.maximum(rows, 0), rows >= 0
        found = looked & ((cols["tiers"][at] & readable) != 0)
        foreign = found & (cols["nbytes"][at] != 100)
        clash = (found & ~foreign & (cols["check"][at] != 0) & (cols["check"][at] != checks)
                 if checks is not None else np.zeros(len(rows), bool))
        before = index.foreign, index.collisions
        got = index.usable(rows, 100, checks, readable)
        assert list(got) == list(np.where(found & ~foreign & ~clash, rows, -1))
        assert (index.foreign - before[0], index.collisions - before[1]) == (foreign.sum(), clash.sum())
        entries = rows[rows >= 0]
        for device_ok in (True, False):
            on_device, device_slots, host_slots, disk = index.locate(entries, device_ok)
            tiers = cols["tiers"][entries]
            on = ((tiers & Tier.DEVICE) != 0) & device_ok
            host = np.where(~on & ((tiers & Tier.HOST) != 0), cols["slot_2"][entries], -1)
            assert list(on_device) == list(on) and list(host_slots) == list(host)
            assert list(device_slots) == list(cols["slot_1"][entries][on])
            assert list(disk) == list(np.flatnonzero(~on & (host < 0)))
    with pytest.raises(IndexError, match="past the index"):
        Index(capacity=4).usable(np.array([9]), 100)
