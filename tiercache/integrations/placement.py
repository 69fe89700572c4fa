"""Where a prefill keeps checkpoints: the page boundaries whose state is likely reused.

A checkpoint costs a slot's bytes (tens of MiB for a real model) and, with segmentable
kernels, no forward pass; one that no later prompt stops at is never used. So, in order of
preference (Marconi's admission; vLLM's align mode with branch points does the same):

- the ends: the prompt's last full page (the next turn extends the prompt) and, with
  `checkpoint_ends`, the page before its last token (a repeat of the prompt loads up to
  there: the last token is always computed);
- the branch point: Match.kv_pages, how far another prompt's cached KV pages reached past
  the hit. Later prompts that share that prefix stop there;
- every `checkpoint_every` pages, deepest first (SGLang's tracking interval), if set.

At most `max_checkpoints` (the store slots of one prefill).
"""

from __future__ import annotations

from typing import Protocol


class Placement(Protocol):
    page_tokens: int
    checkpoint_every: int | None
    checkpoint_ends: bool
    checkpoint_branches: bool
    max_checkpoints: int


def plan(config: Placement, done: int, branch: int, length: int, pages: int) -> list[int]:
    """The page counts, sorted, whose state a prefill of `length` tokens (`pages` full
    pages) that starts after `done` tokens keeps; `branch` pages of KV were cached."""
    page = config.page_tokens
    ends = [pages, (length - 1) // page] if config.checkpoint_ends else []
    if pages * page == length:
        ends.append(pages)  # ends on a boundary: its state is in the cache anyway
    branches = [branch] if config.checkpoint_branches else []
    every = (list(range(config.checkpoint_every, pages, config.checkpoint_every))[::-1]
             if config.checkpoint_every else [])
    wanted: list[int] = []
    for count in [*ends, *branches, *every]:
        if count and done < count * page <= length and count not in wanted:
            wanted.append(count)
    return sorted(wanted[:config.max_checkpoints])
