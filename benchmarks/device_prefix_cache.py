"""The GPU-only baseline of benchmarks.shared_prefix: a prefix cache in the worker's own
(GPU) memory, as an inference server keeps one, with a byte budget and LRU eviction.

It holds what SGLang's radix cache for Mamba holds: KV pages, and recurrent states at
some page boundaries; a hit needs the pages and a state at its end (Match semantics).
Pages and states sit in pools of rows on the worker's device, and hits are copied into
the same staging rows the adapter fills a transformers cache from, so this baseline and
tiercache run the same prefill code (`HybridCacheAdapter`) and differ only in where the
bytes wait between requests and how many fit. The budget counts pages and states
together; each pool has room for the whole budget. Eviction is LRU, leaf-first within a
prefix: a hit or store makes its shallowest page the most recent entry.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import torch

from tiercache.hashing import Keys, Namespace, PageKey, key_array, page_keys
from tiercache.integrations.transformers import device_buffers
from tiercache.layout import Layout
from tiercache.results import LoadResult, Match, StopReason, StoreResult, Tier

PAGE, STATE = "page", "state"


class DevicePrefixCache:
    """Duck-types the `tiercache.client.Worker` calls the adapter makes."""

    def __init__(self, layout: Layout, budget_bytes: int, device: torch.device) -> None:
        self.layout, self.budget, self.device = layout, budget_bytes, device
        staging = device_buffers(layout, device)
        self.paged = {b.name: staging[b.name] for b in layout.paged}
        self.slots = {b.name: staging[b.name] for b in layout.slots}
        self.root = Namespace("device-prefix-cache", layout.fingerprint).root()
        self.sizes = {PAGE: layout.page_bytes, STATE: layout.checkpoint_bytes}
        self.pools = {PAGE: _pool(layout.paged, budget_bytes // layout.page_bytes, device),
                      STATE: _pool(layout.slots, budget_bytes // layout.checkpoint_bytes, device)}
        self.free = {kind: list(range(next(iter(pool.values())).shape[0]))
                     for kind, pool in self.pools.items()}
        self.entries: OrderedDict[tuple[str, PageKey], int] = OrderedDict()  # oldest first
        self.used = 0
        self.evicted = 0
        self._lock = threading.Lock()  # the adapter stores from a thread of its own
        self._stored = None  # on a GPU: an event after the last store's copies into the pools

    def keys(self, tokens: Any) -> list[PageKey]:
        return page_keys(tokens, self.root, self.layout.page_tokens)

    def match(self, tokens: Any = None, *, keys: Keys | None = None) -> Match:
        with self._lock:
            return self._match(_listed(keys))

    def _match(self, keys: list[PageKey]) -> Match:
        walked = 0
        while walked < len(keys) and (PAGE, keys[walked]) in self.entries:
            walked += 1
        pages = walked
        while pages and (STATE, keys[pages - 1]) not in self.entries:
            pages -= 1
        stop = (StopReason.END_OF_PROMPT if pages == len(keys) else
                StopReason.MISSING_PAGE if pages == walked else StopReason.NO_CHECKPOINT)
        return Match(pages, pages * self.layout.page_tokens, len(keys),
                     bytes([Tier.DEVICE]) * pages, Tier.DEVICE if pages else None, stop, walked)

    def load(self, tokens: Any = None, *, keys: Keys | None = None, kv_rows: Sequence[int] = (),
             slot: int | None = None) -> LoadResult:
        with self._lock:
            return self._load(_listed(keys)[:len(kv_rows)], kv_rows, slot)

    def _load(self, keys: list[PageKey], kv_rows: Sequence[int], slot: int | None) -> LoadResult:
        if self._stored is not None:  # a store's copies (on its own stream) come first
            torch.cuda.current_stream(self.device).wait_event(self._stored)
        match = self._match(keys)
        if not match.pages:
            return LoadResult(match, {}, 0)
        pages = keys[:match.pages]
        self._copy(PAGE, self.paged, [self.entries[PAGE, k] for k in pages],
                   list(kv_rows[:match.pages]), into_pool=False)
        self._copy(STATE, self.slots, [self.entries[STATE, pages[-1]]], [slot], into_pool=False)
        self._touch(pages)
        nbytes = match.pages * self.sizes[PAGE] + self.sizes[STATE]
        return LoadResult(match, {Tier.DEVICE: nbytes}, 0)

    def store(self, tokens: Any = None, *, keys: Keys | None = None, kv_rows: Sequence[int] = (),
              checkpoints: Mapping[int, int] | None = None, first_page: int = 0) -> StoreResult:
        with self._lock:
            return self._store(_listed(keys), kv_rows, checkpoints, first_page)

    def _store(self, keys: list[PageKey], kv_rows: Sequence[int],
               checkpoints: Mapping[int, int] | None, first: int) -> StoreResult:
        page = self.layout.page_tokens  # keys are pages first+1..
        states = {keys[n // page - first - 1]: slot for n, slot in (checkpoints or {}).items()}
        new_pages = [i for i, k in enumerate(keys) if (PAGE, k) not in self.entries]
        new_states = [k for k in states if (STATE, k) not in self.entries]
        offered = len(keys) + len(states)
        added = len(new_pages) + len(new_states)
        self._touch(keys)  # what this prompt already has is protected from its own room-making
        keep = {(PAGE, k) for k in keys} | {(STATE, k) for k in states}
        need = len(new_pages) * self.sizes[PAGE] + len(new_states) * self.sizes[STATE]
        if not self._make_room(need, keep):
            return StoreResult(0, offered - added, added)
        self._add(PAGE, self.paged, [keys[i] for i in new_pages], [kv_rows[i] for i in new_pages])
        self._add(STATE, self.slots, new_states, [states[k] for k in new_states])
        if self.device.type == "cuda":
            self._stored = torch.cuda.current_stream(self.device).record_event()
        self._touch(keys)
        return StoreResult(added, offered - added, 0,
                           tuple(sorted(n // page for n in (checkpoints or {}))))

    def close(self) -> None:
        pass

    # -- rows ---------------------------------------------------------------------------
    def _make_room(self, need: int, keep: set) -> bool:
        """Evict the least recent entries (none of `keep`) until `need` more bytes fit."""
        while self.used + need > self.budget:
            oldest = next((e for e in self.entries if e not in keep), None)
            if oldest is None:
                return False
            self.free[oldest[0]].append(self.entries.pop(oldest))
            self.used -= self.sizes[oldest[0]]
            self.evicted += 1
        return True

    def _add(self, kind: str, staging: dict, keys: list[PageKey], src: list[int]) -> None:
        rows = [self.free[kind].pop() for _ in keys]
        self._copy(kind, staging, rows, src, into_pool=True)
        for key, row in zip(keys, rows):
            self.entries[kind, key] = row
        self.used += len(keys) * self.sizes[kind]

    def _copy(self, kind: str, staging: dict, pool_rows: list[int], staging_rows: list,
              into_pool: bool) -> None:
        if not pool_rows:
            return
        pool_ids = torch.tensor(pool_rows, device=self.device)
        staging_ids = torch.tensor(staging_rows, device=self.device)
        for name, pool in self.pools[kind].items():
            if into_pool:
                pool.index_copy_(0, pool_ids, staging[name].index_select(0, staging_ids))
            else:
                staging[name].index_copy_(0, staging_ids, pool.index_select(0, pool_ids))

    def _touch(self, chain: list[PageKey]) -> None:
        """Make the entries of a prefix the most recent, leaf first: the shallowest page
        ends newest, and a state is evicted just before its page."""
        for key in reversed(chain):
            for entry in ((STATE, key), (PAGE, key)):
                if entry in self.entries:
                    self.entries.move_to_end(entry)


def _pool(specs, rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {b.name: torch.empty((max(rows, 1), *b.row_shape), dtype=getattr(torch, b.dtype),
                                device=device) for b in specs}


def _listed(keys: Keys | None) -> list[PageKey]:
    if keys is None or isinstance(keys, list):
        return keys or []
    return [PageKey(row.tobytes()) for row in key_array(keys)]
