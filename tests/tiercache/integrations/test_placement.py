"""Where a prefill keeps checkpoints (no model needed)."""

from dataclasses import dataclass

from tiercache.integrations.placement import plan


@dataclass
class Config:
    page_tokens: int = 16
    checkpoint_every: int | None = None
    checkpoint_ends: bool = True
    checkpoint_branches: bool = True
    max_checkpoints: int = 8


def test_ends_of_a_prompt_inside_and_on_a_page_boundary():
    # 100 tokens: 6 full pages; the last token is in page 7, so both ends are page 6
    assert plan(Config(), 0, 0, 100, 6) == [6]
    # 96 tokens: a repeat loads at most 5 pages, so pages 5 and 6
    assert plan(Config(), 0, 0, 96, 6) == [5, 6]
    # without checkpoint_ends a prompt on a boundary still keeps its end (free), else none
    assert plan(Config(checkpoint_ends=False), 0, 0, 96, 6) == [6]
    assert plan(Config(checkpoint_ends=False), 0, 0, 100, 6) == []


def test_the_branch_point_and_what_the_hit_already_covers():
    # KV of 3 pages was cached without a state: page 3 is kept beside the end
    assert plan(Config(), 0, 3, 100, 6) == [3, 6]
    # a hit of 64 tokens (4 pages) leaves out everything at or before it
    assert plan(Config(), 64, 3, 100, 6) == [6]
    assert plan(Config(checkpoint_branches=False), 0, 3, 100, 6) == [6]


def test_every_n_pages_deepest_first_within_the_slots():
    config = Config(checkpoint_every=2, max_checkpoints=3)
    # 20 pages: ends 20 and 19 come first, then the branch (none), then 18, 16, ...
    assert plan(config, 0, 0, 320, 20) == [18, 19, 20]
    assert plan(Config(checkpoint_every=2), 0, 0, 100, 6) == [2, 4, 6]
