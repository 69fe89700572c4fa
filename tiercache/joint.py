"""The hybrid match of a group: the longest prefix that every member can load.

A group is several registrations that load one prompt together: the tensor-parallel
ranks of an inference engine, and, for a model whose KV cache has several groups of
layers (vLLM's attention and Mamba groups), one registration per cache group of each
rank. Each member's entries live under keys of its own (the daemon masks the group's
keys per member), so one walk over the index per member says where that member stops:
members with paged buffers need KV pages 1..n, members with slot buffers a checkpoint at
exactly n. The joint hit is the largest n that every member allows, so a prefix with
KV on every rank but a state missing on one is no hit at all (invariant 2).

Like the index, this is not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tiercache.index import Index, best_tiers
from tiercache.results import Kind, Match, StopReason, Tier


@dataclass(frozen=True)
class JointHit:
    """A group's match and every index row behind it (for touching and prefetching)."""

    match: Match
    rows: np.ndarray


@dataclass(frozen=True)
class Member:
    """One member's view of a prompt: its keys (already masked) and the sizes of its
    entries (0: it needs no such entries); entries of other sizes are misses."""

    keys: np.ndarray  # uint64 (n, 2)
    page_bytes: int
    checkpoint_bytes: int


def joint_hit(index: Index, members: Sequence[Member], page_tokens: int,
              checks: np.ndarray | None = None) -> JointHit:
    """The longest n at which every member has what it needs, with the rows behind it
    (every member's pages up to n and checkpoints at n). Each page's tier is the worst
    of the members' best tiers: the load is as slow as its slowest member."""
    if not members:
        raise ValueError("a joint match needs at least one member")
    count = len(members[0].keys)
    limit, usable = count, np.ones(count, bool)
    page_rows, checkpoint_rows = [], []
    for member in members:
        if member.page_bytes:
            rows = index.usable(index.rows_of(Kind.PAGE, member.keys), member.page_bytes, checks)
            missing = np.flatnonzero(rows < 0)
            limit = min(limit, int(missing[0]) if missing.size else count)
            page_rows.append(rows)
        if member.checkpoint_bytes:
            rows = index.usable(index.rows_of(Kind.CHECKPOINT, member.keys),
                                member.checkpoint_bytes, checks)
            usable &= rows >= 0
            checkpoint_rows.append(rows)
    pages = limit
    if checkpoint_rows:
        ends = np.flatnonzero(usable[:limit])
        pages = int(ends[-1]) + 1 if ends.size else 0
    return _hit(index, pages, count, limit, page_tokens, page_rows, checkpoint_rows)


def _hit(index: Index, pages: int, count: int, limit: int, page_tokens: int,
         page_rows: list[np.ndarray], checkpoint_rows: list[np.ndarray]) -> JointHit:
    codes = np.zeros(pages, np.uint8)
    for rows in page_rows:
        codes = np.maximum(codes, best_tiers(index.column("tiers", rows[:pages])))
    at_end = [int(rows[pages - 1]) for rows in checkpoint_rows] if pages else []
    checkpoint_tier = None
    if at_end:
        worst = best_tiers(index.column("tiers", np.array(at_end, np.int64))).max()
        checkpoint_tier = Tier(int(worst))
    if pages == count:
        stop = StopReason.END_OF_PROMPT
    elif pages == limit:
        stop = StopReason.MISSING_PAGE
    else:
        stop = StopReason.NO_CHECKPOINT
    match = Match(pages, pages * page_tokens, count, codes.tobytes() if page_rows else b"",
                  checkpoint_tier, stop, limit if page_rows else pages)
    rows = [r[:pages] for r in page_rows] + [np.array(at_end, np.int64)]
    return JointHit(match, np.concatenate(rows).astype(np.int64))
