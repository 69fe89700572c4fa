import numpy as np
import pytest

from tiercache.admission import admit, entry_values
from tiercache.engine import Engine, EngineConfig
from tiercache.flops import saved_flops
from tiercache.layout import BufferSpec, Layout
from tiercache.policy import AdmissionConfig, PolicyConfig
from tiercache.tiers.host import HostConfig
from drills.worlds import hybrid_layout, prompt_keys, random_buffers
from tests.tiercache.test_flops import TINY

POLICY, ALL = AdmissionConfig(), AdmissionConfig(offered="all")
EVERY_PAGE = range(1, 9)


@pytest.mark.parametrize("config, offered, pages, shared, kept", [
    (ALL, EVERY_PAGE, 8, 0, [1, 2, 3, 4, 5, 6, 7, 8]),  # the baseline keeps everything
    (POLICY, EVERY_PAGE, 8, 0, [8]),  # nothing shared: the end only
    (POLICY, EVERY_PAGE, 8, 5, [5, 8]),  # pages 1..5 were cached, page 6 was not: branch at 5
    (POLICY, [3, 6, 8], 8, 5, [3, 8]),  # no offer at 5: the deepest one before it
    (POLICY, [6, 8], 8, 5, [8]),  # no offer at or before the branch point
    (POLICY, EVERY_PAGE, 8, 8, [8]),  # all cached already: the end is the only stop
    (POLICY, [2, 4], 5, 0, []),  # the end was not offered
    (AdmissionConfig(interval=3), EVERY_PAGE, 8, 2, [2, 3, 6, 8]),  # branch, every 3, end
    (POLICY, [], 8, 5, []),
])
def test_admission_keeps_the_end_the_branch_point_and_the_interval(config, offered, pages, shared, kept):
    assert admit(config, offered, pages, shared).tolist() == kept


# a checkpoint of 16 KiB holds as many bytes as 8 KV pages of 2 KiB
SHAPED = Layout(16, paged=hybrid_layout().paged, slots=(BufferSpec("state", 8, (64, 64), "float32"),),
                model=TINY)


def efficiency(layout, start, end):
    """FLOPs a checkpoint at `end` with the previous one at `start` saves, per byte held."""
    saved = saved_flops(layout.model, 16, end) - saved_flops(layout.model, 16, start)
    return saved / (layout.checkpoint_bytes + (end - start) * layout.page_bytes)


def test_pages_carry_the_best_segment_at_or_after_them_and_a_tail_is_worth_nothing():
    # checkpoints at 2 and 6 on an 8-page chain: segments (0, 2] and (2, 6], tail 7..8
    pages, ends = entry_values(SHAPED, 8, np.array([2, 6]))
    first, second = efficiency(SHAPED, 0, 2), efficiency(SHAPED, 2, 6)
    assert second > first  # the longer segment holds fewer checkpoint bytes per FLOP
    assert np.allclose(pages, [second] * 6 + [0, 0], rtol=1e-6)
    assert np.allclose(ends, [second, second], rtol=1e-6)


def test_a_short_tail_after_a_long_shared_prefix_is_worth_less_than_the_prefix():
    # a shared prefix of 6 pages checkpointed at 6, then a private tail of 1 page
    pages, ends = entry_values(SHAPED, 7, np.array([6, 7]))
    prefix, tail = efficiency(SHAPED, 0, 6), efficiency(SHAPED, 6, 7)
    assert tail < prefix
    assert np.allclose(pages, [prefix] * 6 + [tail], rtol=1e-6)
    assert np.allclose(ends, [prefix, tail], rtol=1e-6)


def test_attention_only_pages_are_segments_of_their_own_and_no_model_counts_tokens():
    layout = Layout(16, paged=hybrid_layout().paged)
    pages, ends = entry_values(layout, 3, np.array([], np.int64))
    # without a model every page saves its 16 tokens: worth the same all along
    assert np.allclose(pages, [16 / layout.page_bytes] * 3) and len(ends) == 0


def engine_with(admission=POLICY):
    config = EngineConfig(host=HostConfig(budget_bytes=1 << 26, pin=False),
                          policy=PolicyConfig(admission=admission))
    return Engine.open(config)


LAYOUT = hybrid_layout(page_rows=64, slot_rows=16)


def offer_every_page(pages):
    return {n: n % 16 for n in range(1, pages + 1)}


def test_a_store_keeps_what_the_policy_admits_and_says_so():
    engine = engine_with()
    worker = random_buffers(LAYOUT, seed=1)
    system = np.random.default_rng(0).integers(0, 1000, 4 * 16).tolist()  # a 4-page system prompt
    first = prompt_keys(LAYOUT, seed=1, pages=3, prefix=system)  # 7 pages
    # 1. a fresh prompt of 7 pages, offered at every page: only the end is kept
    result = engine.store(worker, first, range(7), offer_every_page(7))
    assert result.checkpoints == (7,) and result.stored == 8
    assert engine.stats().counters["declined_checkpoints"] == 6
    # 2. a second prompt shares the 4 system pages and diverges on page 5: branch at 4
    second = prompt_keys(LAYOUT, seed=2, pages=2, prefix=system)  # 6 pages
    result = engine.store(worker, second, range(10, 16), offer_every_page(6))
    assert result.checkpoints == (4, 6)
    assert (result.stored, result.present) == (2 + 2, 4)  # 2 pages + 2 checkpoints new
    # 3. a third prompt of the same group now hits the whole system prompt
    third = prompt_keys(LAYOUT, seed=3, pages=2, prefix=system)
    assert engine.match(LAYOUT, third).pages == 4


def test_the_next_turn_of_a_conversation_hits_the_previous_turn():
    engine = engine_with()
    worker = random_buffers(LAYOUT, seed=1)
    turn = np.random.default_rng(0).integers(0, 1000, 5 * 16).tolist()
    first = prompt_keys(LAYOUT, seed=1, pages=0, prefix=turn)  # 5 pages
    assert engine.store(worker, first, range(5), offer_every_page(5)).checkpoints == (5,)
    # the second turn extends the first by 3 pages: the branch point is its end, cached
    second = prompt_keys(LAYOUT, seed=2, pages=3, prefix=turn)
    assert engine.match(LAYOUT, second).pages == 5
    result = engine.store(worker, second, range(8), offer_every_page(8))
    assert result.checkpoints == (5, 8) and result.present == 5 + 1


def test_admitting_all_keeps_every_offer():
    engine = engine_with(ALL)
    worker = random_buffers(LAYOUT, seed=1)
    keys = prompt_keys(LAYOUT, seed=1, pages=5)
    assert engine.store(worker, keys, range(5), offer_every_page(5)).checkpoints == (1, 2, 3, 4, 5)
    # every prefix now has its checkpoint: a prompt sharing only 2 pages hits 2
    assert engine.match(LAYOUT, keys[:2]).pages == 2


def test_store_rates_entries_by_flops_per_byte_and_a_new_checkpoint_raises_its_pages():
    engine = engine_with()
    worker = random_buffers(SHAPED, seed=1)
    keys = prompt_keys(SHAPED, seed=1, pages=6)
    # 1. pages alone: no checkpoint on the chain yet, so none of them saves anything
    engine.store_pages(worker, keys, range(6))
    rows = engine.index.rows_of(0, np.frombuffer(b"".join(keys), np.uint64).reshape(-1, 2))
    assert engine.index.column("value", rows).tolist() == [0.0] * 6
    # 2. a checkpoint at 4: pages 1..4 and it are worth what the segment saves per byte
    engine.store_checkpoint(worker, keys[:4], slot=0)
    expected = np.float32(efficiency(SHAPED, 0, 4))
    assert engine.index.column("value", rows).tolist() == [expected] * 4 + [0.0] * 2
