"""A store that sends only what it adds after a hit (`Engine.store(first_page=)`, proto
StoreRequest.first_page): the pages and checkpoints land where a store of the whole prompt
puts them, and what it sends is checked against the pages it names."""

import numpy as np
import pytest

from tiercache.engine import Engine, EngineConfig
from tiercache.errors import InvalidArgument
from tiercache.results import Kind
from tiercache.tiers.host import HostConfig
from tiercache.hashing import key_array
from drills.worlds import hybrid_layout, page_bytes, prompt_keys, random_buffers, same, slot_bytes

LAYOUT = hybrid_layout(page_rows=64, slot_rows=8)


def test_a_suffix_store_extends_a_loaded_prefix_with_the_depths_of_the_whole_prompt():
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 24, pin=False)))
    worker = random_buffers(LAYOUT, seed=1)
    # Prompt A: 4 pages and the state after them.
    a = prompt_keys(LAYOUT, seed=2, pages=4)
    engine.store(worker, a, range(4), {4: 0})
    # Prompt B shares A's 4 pages and adds 3: after its hit it sends pages 5-7 only, from
    # rows 10-12, with the state after page 7 from slot 1.
    tokens_a = np.random.default_rng(2).integers(0, 150_000, 4 * LAYOUT.page_tokens).tolist()
    b = prompt_keys(LAYOUT, seed=3, pages=3, prefix=tokens_a)
    assert b[:4] == a
    hit = engine.load(random_buffers(LAYOUT, seed=9), b, range(20, 27), slot=2)
    assert hit.match.pages == 4
    result = engine.store(worker, b[4:], range(10, 13), {7: 1}, first_page=4)
    assert (result.stored, result.checkpoints) == (4, (7,))  # 3 pages and 1 checkpoint
    # The whole prompt now hits, with B's new pages and state.
    other = random_buffers(LAYOUT, seed=10)
    loaded = engine.load(other, b, range(30, 37), slot=3)
    assert loaded.match.pages == 7
    assert same(page_bytes(other, range(34, 37)), page_bytes(worker, range(10, 13)))
    assert same(slot_bytes(other, 3), slot_bytes(worker, 1))
    # Stored at their depths in the prompt (5-7 and 7), as a store of all 7 keys would.
    rows = engine.books.rows_of(Kind.PAGE, key_array(b[4:]))
    assert engine.books.index._cols["depth"][rows].tolist() == [5, 6, 7]
    engine.close()


def test_checkpoints_outside_the_pages_sent_are_refused():
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 24, pin=False)))
    worker = random_buffers(LAYOUT, seed=4)
    keys = prompt_keys(LAYOUT, seed=5, pages=6)
    for offered in ({4: 0}, {2: 0}, {7: 0}):  # at or before page 4, or past page 6
        with pytest.raises(InvalidArgument, match="outside the pages sent, 5 to 6"):
            engine.store(worker, keys[4:], range(2), offered, first_page=4)
    with pytest.raises(InvalidArgument, match="first_page"):
        engine.store(worker, [], (), {}, first_page=4)
    engine.close()
