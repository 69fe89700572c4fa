"""tiercache for Hugging Face transformers hybrid models (Qwen3-Next, Qwen3.5, Nemotron-H, ...).

    config = AdapterConfig(model_id="org/name@rev")
    adapter = HybridCacheAdapter.for_model(model, Client(address), config)  # or EmbeddedClient()
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

The adapter talks to tiercache through a registered worker (`tiercache.client.Worker`):
`for_model` registers the cache's layout with a daemon `Client`, an `EmbeddedClient` or
an `Engine` in this process, and the worker's buffers are the staging rows that prefixes
pass through (shared memory on the CPU; on a GPU, CUDA memory of the adapter's own that
the daemon opens by IPC). One adapter serves one sequence at a time (batch size 1) and is
not thread-safe: its staging rows are shared by its calls. `close` ends the registration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from tiercache.client import Client, EmbeddedClient
from tiercache.engine import Engine, LoadResult, StoreResult
from tiercache.errors import InvalidArgument
from tiercache.hashing import Keys, PageKey
from tiercache.results import Match, StopReason
from tiercache.integrations.hf_cache import (
    Cache, CacheSpec, DynamicCache, Staging, UnsupportedCache)
from tiercache.layout import Layout

__all__ = ["AdapterConfig", "CacheSpec", "Connection", "HybridCacheAdapter", "Prefill",
           "Restored", "UnsupportedCache"]


class Connection(Protocol):
    """What the adapter needs of tiercache: a registered `tiercache.client.Worker`."""

    layout: Layout
    paged: Mapping[str, torch.Tensor]
    slots: Mapping[str, torch.Tensor]

    def keys(self, tokens: Any) -> list[PageKey]: ...
    def match(self, tokens: Any = None, *, keys: Keys | None = None) -> Match: ...
    def load(self, tokens: Any = None, *, keys: Keys | None = None, kv_rows: Sequence[int] = (),
             slot: int | None = None) -> LoadResult: ...
    def store(self, tokens: Any = None, *, keys: Keys | None = None, kv_rows: Sequence[int] = (),
              checkpoints: Mapping[int, int] | None = None) -> StoreResult: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class AdapterConfig:
    model_id: str  # names the weights: bytes of two different checkpoints must never mix
    page_tokens: int = 16
    max_tokens: int = 8192  # the longest prefix cached; sizes the staging rows
    checkpoint_every: int | None = None  # pages between extra checkpoints during prefill
    # Also stop at the last full page and, for a prompt that ends on a page boundary, at
    # the page before it (as far as a repeat of the prompt can load): one more forward pass
    # each. Off suits prompts that are never extended or repeated. A prompt that ends on a
    # boundary keeps the checkpoint at its end either way: it costs no extra pass.
    checkpoint_ends: bool = True
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
class Prefill:
    cache: Cache  # has seen the whole prompt
    logits: torch.Tensor  # [1, computed tokens, vocab] after the hit, or [1, 1, vocab] (last_only)
    loaded_tokens: int
    chunks: tuple[int, ...]  # tokens per forward pass, in order
    load: LoadResult
    stores: tuple[StoreResult, ...]  # one per store: the pages and the checkpoint at its end

    @property
    def computed_tokens(self) -> int:
        return sum(self.chunks)


# A prompt under one full page has no key: nothing is asked for (a daemon refuses empty prompts).
_MISS = Match(0, 0, 0, b"", None, StopReason.MISSING_PAGE)


class HybridCacheAdapter:
    """Prefixes of one model's cache through a registered tiercache worker: `prefill`,
    or `load` and `store` for callers that run the model themselves."""

    def __init__(self, worker: Connection, spec: CacheSpec, config: AdapterConfig,
                 new_cache: Callable[[], Cache], device: torch.device | str) -> None:
        expected = spec.layout(config.page_tokens, config.max_pages)
        if worker.layout != expected:
            raise InvalidArgument("the worker was registered with another layout than this "
                                  "cache's: register spec.layout(page_tokens, max_pages)")
        self.worker = worker
        self.spec = spec
        self.config = config
        self.new_cache = new_cache
        self.device = torch.device(device)
        self.layout = worker.layout
        self.staging = Staging(spec, config.page_tokens, worker.paged, worker.slots)

    @classmethod
    def for_model(cls, model: torch.nn.Module, cache: Client | EmbeddedClient | Engine,
                  config: AdapterConfig) -> "HybridCacheAdapter":
        """An adapter for `model`'s own cache (`DynamicCache(config=model.config)`), registered
        with `cache`. A model on a GPU gets staging rows on its GPU (CUDA IPC to a daemon)."""
        def new_cache() -> Cache:
            return DynamicCache(config=model.config)
        spec = CacheSpec.probe(model, new_cache)
        device = next(model.parameters()).device
        layout = spec.layout(config.page_tokens, config.max_pages)
        client = EmbeddedClient(cache) if isinstance(cache, Engine) else cache
        buffers = device_buffers(layout, device) if device.type == "cuda" else None
        worker = client.register(config.model_id, layout, extra_keys=config.extra, buffers=buffers)
        return cls(worker, spec, config, new_cache, device)

    def close(self) -> None:
        """End the registration (a daemon unmaps the staging rows)."""
        self.worker.close()

    def __enter__(self) -> "HybridCacheAdapter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys and the store ------------------------------------------------------------
    def keys(self, tokens: Any) -> list[PageKey]:
        """Page keys of the full pages of `tokens` (1-D), up to max_tokens."""
        return self.worker.keys(_flat(tokens)[:self.config.max_pages * self.config.page_tokens])

    def match(self, tokens: Any) -> Match:
        keys = self.keys(tokens)
        return self.worker.match(keys=keys) if keys else _MISS

    def _load(self, keys: list[PageKey]) -> LoadResult:
        if not keys:
            return LoadResult(_MISS, {}, 0)
        rows = range(len(keys)) if self.layout.needs_pages else ()
        slot = 0 if self.layout.needs_checkpoint else None
        return self.worker.load(keys=keys, kv_rows=rows, slot=slot)

    def _store(self, keys: list[PageKey], checkpoint: bool) -> StoreResult | None:
        """Store rows 0..len(keys)-1 as those pages and, if asked, slot 0 as the state after
        the last one, in one call: the checkpoint is at the end of the keys, so the
        engine's admission always keeps it."""
        if not keys:
            return None
        rows = range(len(keys)) if self.layout.needs_pages else ()
        offer = checkpoint and self.layout.needs_checkpoint
        return self.worker.store(keys=keys, kv_rows=rows, checkpoints={
            len(keys) * self.config.page_tokens: 0} if offer else None)

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

    def store(self, tokens: Any, cache: Cache) -> StoreResult | None:
        """Store the KV pages of a cache that has seen exactly `tokens` and, if their count
        is a multiple of page_tokens, its state as the checkpoint of the last page. (A state
        after a partial page is no checkpoint at all: `prefill` stops on the boundary.)
        None when `tokens` has no full page."""
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
    def prefill(self, model: torch.nn.Module, input_ids: torch.Tensor,
                last_only: bool = False) -> Prefill:
        """Load the longest hit of `input_ids` ([1, N]), run `model` on the rest in chunks
        that end on checkpoint boundaries, and store pages and checkpoints there. With
        `last_only`, only the last token's logits are computed (`logits_to_keep=1`): a
        long prompt's logits would take more memory than its cache."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise InvalidArgument(
                f"input_ids must have shape [1, tokens], got {tuple(input_ids.shape)}")
        keys = self.keys(input_ids[0])
        # At least one token is left to compute: its logits pick the next token.
        restored = self._restore(keys[:(input_ids.shape[1] - 1) // self.config.page_tokens])
        cache, done, staged = restored.cache, restored.tokens, restored.load.match.pages
        stops, checkpoints = self._plan(done, input_ids.shape[1], len(keys))
        extra = {"logits_to_keep": 1} if last_only else {}
        chunks, logits, stores = [], [], []
        for end in stops:
            out = model(input_ids=input_ids[:, done:end], past_key_values=cache, use_cache=True,
                        **extra)
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
        kept = logits[-1] if last_only else torch.cat(logits, dim=1)
        return Prefill(cache, kept, restored.tokens, tuple(chunks), restored.load, tuple(stores))

    def _plan(self, done: int, length: int, pages: int) -> tuple[list[int], set[int]]:
        """Where the forward passes end (token counts), and which of those ends are kept as
        checkpoints, after `done`: every `checkpoint_every` pages; the end of a prompt that
        ends on a page boundary; with `checkpoint_ends`, the last full page and the last
        one before the final token, which is as far as a later run of this same prompt
        loads (they differ when the prompt ends on a boundary).
        Without linear-attention state there is nothing to stop for: one pass does."""
        if not self.layout.needs_checkpoint:
            return [length], set()
        page_tokens, every = self.config.page_tokens, self.config.checkpoint_every
        wanted = {pages} if pages * page_tokens == length else set()
        if self.config.checkpoint_ends:
            wanted |= {pages, min(pages, (length - 1) // page_tokens)}
        wanted |= set(range(every, pages, every)) if every else set()
        checkpoints = {p * page_tokens for p in wanted if p and done < p * page_tokens <= length}
        return sorted(checkpoints | {length}), checkpoints


def device_buffers(layout: Layout, device: torch.device) -> dict[str, torch.Tensor]:
    """Every buffer of `layout` carved out of one allocation on `device`: a CUDA IPC handle
    exposes the whole allocation it names, so the daemon sees these rows and nothing else."""
    align = 512  # keeps every view aligned for any dtype and for vectorised copies
    specs = (*layout.paged, *layout.slots)
    offsets, total = [], 0
    for spec in specs:
        offsets.append(total)
        total += -(-spec.rows * spec.row_bytes // align) * align
    block = torch.zeros(total, dtype=torch.uint8, device=device)
    return {spec.name: block[at:at + spec.rows * spec.row_bytes].view(getattr(torch, spec.dtype))
            .view(spec.shape) for spec, at in zip(specs, offsets)}


def _flat(tokens: Any) -> Any:
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.shape[0] == 1:
        return tokens[0]
    return tokens
