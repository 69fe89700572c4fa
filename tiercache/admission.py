"""Which offered checkpoints a store keeps, and what each stored entry is worth.

Admission (`AdmissionConfig.offered == "policy"`). A worker may offer the state at every
page boundary, but one checkpoint costs the memory of dozens of KV pages, and one that no
later prompt stops at is never used. Of the page counts offered, a store keeps:
  - the end: the checkpoint after the prompt's last full page (the next turn of a
    conversation extends the prompt, a retry repeats it);
  - the branch point: with `shared` the number of leading pages of the prompt that were
    cached (in any tier) before the store, i.e. page shared + 1 is the first whose key is
    not cached, and 0 < shared < pages: the deepest offer at or before `shared`. This
    prompt left a cached one there, so later prompts sharing that prefix can stop there;
  - every `interval` pages, if an interval is set.

Worth (for FLOP-aware eviction). In a hybrid model a KV page saves nothing alone: without
the recurrent state after it, the SSM layers, and every layer above them, rerun over the
whole prefix. A checkpoint at page n turns the pages since the previous checkpoint m on
its chain into a hit: together they save S(n) - S(m) (`flops.saved_flops`: every layer's
prefill of pages m+1..n, which grows with depth through attention) for the bytes of the
checkpoint and of those pages. That efficiency is the segment's FLOPs saved beyond its
parent per byte, and every entry of the segment carries it. A page also serves every
checkpoint deeper on its chain, so its value is raised to the best found further down:
parents never rank below their children and eviction stays leaf-first. Pages after the
chain's last checkpoint are worth 0. Attention-only layouts need no checkpoints: every
page is a segment of its own. Values are set at store time and only ever raised, so they
go stale when a segment's checkpoint is evicted (its pages keep their value until they are
evicted too, by age) and they are not kept on disk (an index rebuilt from disk starts at 0).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from tiercache.flops import saved_flops
from tiercache.layout import Layout
from tiercache.policy import AdmissionConfig


def admit(config: AdmissionConfig, offered: Iterable[int], pages: int, shared: int) -> np.ndarray:
    """The offered page counts to keep (sorted), for a prompt of `pages` full pages whose
    first `shared` pages were cached before the store."""
    offers = np.unique(np.fromiter(offered, np.int64))
    if config.offered == "all" or not len(offers):
        return offers
    keep = offers == pages
    if 0 < shared < pages and offers[0] <= shared:
        keep |= offers == offers[offers <= shared][-1]
    if config.interval:
        keep |= offers % config.interval == 0
    return offers[keep]


def entry_values(layout: Layout, pages: int, checkpoints: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(value of pages 1..pages, value of the checkpoint at each of `checkpoints`) for a
    chain whose checkpoints, cached or being stored, lie at the sorted, distinct page
    counts `checkpoints`. Values are FLOPs (or tokens, without a model shape) per byte."""
    checkpoints = np.asarray(checkpoints, np.int64)
    ends = checkpoints if layout.needs_checkpoint else np.arange(1, pages + 1)
    if not len(ends):
        return np.zeros(pages, np.float32), np.zeros(0, np.float32)
    starts = np.concatenate([[0], ends[:-1]])
    saved = saved_flops(layout.model, layout.page_tokens, np.concatenate([[0], ends]),
                        layout.tp_size)
    held = layout.checkpoint_bytes + (ends - starts) * layout.page_bytes
    per_page = np.zeros(pages, np.float64)
    per_page[:ends[-1]] = np.repeat(np.diff(saved) / held, ends - starts)
    # a page is worth the best segment at or after it on the chain
    per_page = np.maximum.accumulate(per_page[::-1])[::-1]
    at_checkpoints = per_page[checkpoints - 1] if layout.needs_checkpoint else np.zeros(0)
    return per_page.astype(np.float32), at_checkpoints.astype(np.float32)
