"""tiercache for Hugging Face transformers hybrid models (Qwen3-Next, Qwen3.5, Nemotron-H, ...).

    adapter = HybridCacheAdapter.for_model(model, engine, AdapterConfig(model_id="org/name@rev"))
    run = adapter.prefill(model, input_ids)   # loads the longest hit, computes and stores the rest
    next_token = run.logits[0, -1].argmax()   # run.cache continues generation from here

How `hf_cache` lays a cache out as rows is described there. This module adds the
prompt's page keys and the prefill that makes checkpoints possible at all: the state a
linear-attention layer holds after N tokens is a checkpoint for page N / page_tokens only
when N is a multiple of page_tokens, and it cannot be rewound. So `prefill` runs the
model in chunks that end on the page boundaries where it keeps a checkpoint (see
`_plan`), stores the KV pages and the state there, and only then runs on. The tokens
after the last full page are computed last and never stored. Splitting changes the order
of floating-point sums, not the function, so the logits stay within rounding of one
unsplit forward pass, and a prefix loaded back is bit-identical to the same prefix kept
in memory.

The adapter talks to the store through four calls (`Backend`), all made in this file's
`match`, `_load` and `_store`: the embedded `Engine`, or a client of the daemon with the
same methods. One adapter serves one sequence at a time (batch size 1) and is not
thread-safe: its staging rows are shared by its calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from tiercache.buffers import WorkerBuffers
from tiercache.engine import LoadResult, StoreResult
from tiercache.errors import InvalidArgument
from tiercache.hashing import Namespace, PageKey, page_keys
from tiercache.index import Match
from tiercache.integrations.hf_cache import (
    Cache, CacheSpec, DynamicCache, Staging, UnsupportedCache)
from tiercache.layout import BufferSpec, Layout

__all__ = ["AdapterConfig", "Backend", "CacheSpec", "HybridCacheAdapter", "Prefill", "Restored",
           "Stored", "UnsupportedCache"]


class Backend(Protocol):
    """What the adapter needs from a store: `tiercache.engine.Engine` or a daemon client."""

    def store_pages(self, buffers: WorkerBuffers, keys: Sequence[PageKey],
                    rows: Sequence[int]) -> StoreResult: ...

    def store_checkpoint(self, buffers: WorkerBuffers, keys: Sequence[PageKey],
                         slot: int) -> StoreResult: ...

    def match(self, layout: Layout, keys: Sequence[PageKey]) -> Match: ...

    def load(self, buffers: WorkerBuffers, keys: Sequence[PageKey], rows: Sequence[int] = (),
             slot: int | None = None) -> LoadResult: ...


@dataclass(frozen=True)
class AdapterConfig:
    model_id: str  # names the weights: bytes of two different checkpoints must never mix
    page_tokens: int = 16
    max_tokens: int = 8192  # the longest prefix cached; sizes the staging rows
    checkpoint_every: int | None = None  # pages between extra checkpoints during prefill
    tenant: str = ""
    extra: tuple[str, ...] = ()  # LoRA id, multimodal hashes, ...

    def __post_init__(self) -> None:
        if self.page_tokens <= 0:
            raise InvalidArgument(f"page_tokens must be positive, got {self.page_tokens}")
        if self.max_tokens < self.page_tokens:
            raise InvalidArgument(f"max_tokens {self.max_tokens} is under one page of "
                                  f"{self.page_tokens} tokens: nothing could be cached")
        if self.checkpoint_every is not None and self.checkpoint_every <= 0:
            raise InvalidArgument(f"checkpoint_every must be a positive number of pages, "
                                  f"got {self.checkpoint_every}")

    @property
    def max_pages(self) -> int:
        return self.max_tokens // self.page_tokens


@dataclass(frozen=True)
class Restored:
    """A cache rebuilt from the longest hybrid hit: it has seen the first `tokens` tokens."""

    cache: Cache
    tokens: int
    load: LoadResult


@dataclass(frozen=True)
class Stored:
    pages: StoreResult | None  # None when there were no full pages
    checkpoint: StoreResult | None  # None when the cache did not end on a page boundary


@dataclass(frozen=True)
class Prefill:
    cache: Cache  # has seen the whole prompt
    logits: torch.Tensor  # [1, computed tokens, vocab]: of the tokens after the hit only
    loaded_tokens: int
    chunks: tuple[int, ...]  # tokens per forward pass, in order
    load: LoadResult
    stores: tuple[Stored, ...]


Allocate = Callable[[BufferSpec], torch.Tensor]


class HybridCacheAdapter:
    """Staging rows live on the CPU by default, where the embedded engine reads them. A
    daemon client passes `allocate` to put them where the daemon can read them (shared
    memory, or device memory it opens through CUDA IPC)."""

    def __init__(self, backend: Backend, spec: CacheSpec, config: AdapterConfig,
                 new_cache: Callable[[], Cache], device: torch.device | str,
                 allocate: Allocate | None = None) -> None:
        self.backend = backend
        self.spec = spec
        self.config = config
        self.new_cache = new_cache
        self.device = torch.device(device)
        self.layout = spec.layout(config.page_tokens, config.max_pages)
        self.root = Namespace(config.model_id, self.layout.fingerprint, config.tenant,
                              config.extra).root()
        self.staging = Staging(spec, self.layout, allocate or _zeros_on("cpu"))

    @classmethod
    def for_model(cls, model: torch.nn.Module, backend: Backend, config: AdapterConfig,
                  allocate: Allocate | None = None) -> "HybridCacheAdapter":
        """An adapter for `model`'s own cache (`DynamicCache(config=model.config)`)."""
        def new_cache() -> Cache:
            return DynamicCache(config=model.config)
        spec = CacheSpec.probe(model, new_cache)
        device = next(model.parameters()).device
        return cls(backend, spec, config, new_cache, device, allocate)

    # -- keys and the store ------------------------------------------------------------
    def keys(self, tokens: Any) -> list[PageKey]:
        """Page keys of the full pages of `tokens` (1-D), up to max_tokens."""
        return page_keys(_flat(tokens)[:self.config.max_pages * self.config.page_tokens],
                         self.root, self.config.page_tokens)

    def match(self, tokens: Any) -> Match:
        return self.backend.match(self.layout, self.keys(tokens))

    def _load(self, keys: list[PageKey]) -> LoadResult:
        rows = range(len(keys)) if self.layout.needs_pages else ()
        return self.backend.load(self.staging.buffers, keys, rows=rows, slot=0)

    def _store(self, keys: list[PageKey], checkpoint: bool) -> Stored:
        """Store rows 0..len(keys)-1 as those pages and, if asked, slot 0 as the state after
        the last one. Pages go first: a checkpoint is useless without its pages."""
        if not keys:
            return Stored(None, None)
        buffers = self.staging.buffers
        pages = (self.backend.store_pages(buffers, keys, range(len(keys)))
                 if self.layout.needs_pages else None)
        state = (self.backend.store_checkpoint(buffers, keys, 0)
                 if checkpoint and self.layout.needs_checkpoint else None)
        return Stored(pages, state)

    # -- the cache side ------------------------------------------------------------------
    def load(self, tokens: Any) -> Restored:
        """A cache that has seen the longest cached prefix of `tokens` (an empty cache on a
        miss). To get logits for the last token, pass all tokens but the last one."""
        return self._restore(self.keys(tokens))

    def _restore(self, keys: list[PageKey]) -> Restored:
        result = self._load(keys)
        cache = self.new_cache()
        if result.match.pages:
            self.staging.fill(cache, result.match.pages, self.device)
        return Restored(cache, result.match.tokens, result)

    def store(self, tokens: Any, cache: Cache) -> Stored:
        """Store the KV pages of a cache that has seen exactly `tokens` and, if their count
        is a multiple of page_tokens, its state as the checkpoint of the last page. (A state
        after a partial page is no checkpoint at all: `prefill` stops on the boundary.)"""
        tokens = _flat(tokens)
        self._check_length(cache, len(tokens))
        keys = self.keys(tokens)
        self.staging.pages_from(cache, 0, len(keys))
        at_boundary = len(tokens) == len(keys) * self.config.page_tokens
        if at_boundary:
            self.staging.state_from(cache)
        return self._store(keys, checkpoint=at_boundary)

    def _check_length(self, cache: Cache, length: int) -> None:
        for kv in self.spec.kv:  # without KV layers, only the caller knows the length
            seen = cache.layers[kv.layer].get_seq_length()
            if seen != length:
                raise InvalidArgument(f"the cache has seen {seen} tokens but {length} tokens were "
                                      "given: pass exactly the tokens the cache was filled with")

    # -- prefill ------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, model: torch.nn.Module, input_ids: torch.Tensor) -> Prefill:
        """Load the longest hit of `input_ids` ([1, N]), run `model` on the rest in chunks
        that end on checkpoint boundaries, and store pages and checkpoints there."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise InvalidArgument(
                f"input_ids must have shape [1, tokens], got {tuple(input_ids.shape)}")
        keys = self.keys(input_ids[0])
        # At least one token is left to compute: its logits pick the next token.
        restored = self._restore(keys[:(input_ids.shape[1] - 1) // self.config.page_tokens])
        cache, done, staged = restored.cache, restored.tokens, restored.load.match.pages
        stops, checkpoints = self._plan(done, input_ids.shape[1], len(keys))
        chunks, logits, stores = [], [], []
        for end in stops:
            out = model(input_ids=input_ids[:, done:end], past_key_values=cache, use_cache=True)
            chunks.append(end - done)
            logits.append(out.logits)
            done = end
            if end in checkpoints:  # the state is exactly at this page boundary now
                pages = end // self.config.page_tokens
                self.staging.pages_from(cache, staged, pages)  # rows below `staged` hold theirs
                self.staging.state_from(cache)
                staged = pages
                stores.append(self._store(keys[:pages], checkpoint=True))
        if staged < len(keys):  # KV-only caches: the pages are cut out after one pass
            self.staging.pages_from(cache, staged, len(keys))
            stores.append(self._store(keys, checkpoint=False))
        return Prefill(cache, torch.cat(logits, dim=1), restored.tokens, tuple(chunks),
                       restored.load, tuple(stores))

    def _plan(self, done: int, length: int, pages: int) -> tuple[list[int], set[int]]:
        """Where the forward passes end (token counts), and which of those ends are kept as
        checkpoints, after `done`: the last full page; the last one before the final token,
        which is as far as a later run of this same prompt loads (they differ when the
        prompt ends on a boundary); and every `checkpoint_every` pages.
        Without linear-attention state there is nothing to stop for: one pass does."""
        if not self.layout.needs_checkpoint:
            return [length], set()
        page_tokens, every = self.config.page_tokens, self.config.checkpoint_every
        wanted = {pages, min(pages, (length - 1) // page_tokens)}
        wanted |= set(range(every, pages, every)) if every else set()
        checkpoints = {p * page_tokens for p in wanted if p and done < p * page_tokens <= length}
        return sorted(checkpoints | {length}), checkpoints


def _zeros_on(device: torch.device | str) -> Allocate:
    return lambda spec: torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device=device)


def _flat(tokens: Any) -> Any:
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.shape[0] == 1:
        return tokens[0]
    return tokens
