"""tiercache for Hugging Face transformers hybrid models (Qwen3-Next, Qwen3.5, Nemotron-H, ...).

    config = AdapterConfig(model_id="org/name@rev")
    adapter = HybridCacheAdapter.for_model(model, Client(address), config)  # or EmbeddedClient()
    run = adapter.prefill(model, input_ids)   # loads the longest hit, computes the rest
    next_token = run.logits[0, -1].argmax()   # run.cache continues generation from here
    adapter.flush()                           # (stores run behind; close() waits for them too)

How `hf_cache` lays a cache out as rows is described there. This module adds the
prompt's page keys and a prefill that leaves checkpoints behind: the state a
linear-attention layer holds after N tokens is a checkpoint for page N / page_tokens only
when N is a multiple of page_tokens, and it cannot be rewound. `prefill`

1. loads the longest hybrid hit in one call (the KV pages into staging rows, the state into
   the load slot) and rebuilds a transformers cache from it, one copy per tensor;
2. picks the page boundaries worth a checkpoint (`plan`): the prompt's end (its last full
   page, and the one before its last token: as far as a repeat of it loads), the branch
   point (how far the cached KV pages of another prompt reached past the hit: Match.kv_pages,
   Marconi's admission), and with `checkpoint_every` every that many pages;
3. computes the rest in ONE forward pass, its linear-attention kernels run in segments
   that keep the states at those boundaries (`capture`). A model whose kernels cannot be
   segmented runs one pass per boundary instead (said in a log line, once);
4. copies the new KV pages and the states into staging rows and slots, and hands the store
   to a background thread (`stores`): the logits come back without waiting for it. State
   slots are double-buffered, so the next prefill waits only if it must write rows or
   slots a store still reads.

The logits stay within rounding of one plain forward pass (GEMMs over other shapes round
differently), and a prefix loaded back continues bit-identically to the same states kept
in memory (DESIGN.md invariant 7).

The adapter talks to tiercache through a registered worker (`tiercache.client.Worker`):
`for_model` registers the cache's layout with a daemon `Client`, an `EmbeddedClient` or
an `Engine` in this process, and the worker's buffers are the staging rows that prefixes
pass through (shared memory on the CPU; on a GPU, CUDA memory of the adapter's own that
the daemon opens by IPC). One adapter serves one sequence at a time (batch size 1) from one
thread; `close` waits for its stores and ends the registration.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from tiercache.client import Client, EmbeddedClient
from tiercache.engine import Engine, LoadResult, StoreResult
from tiercache.errors import InvalidArgument
from tiercache.hashing import Keys, PageKey
from tiercache.integrations import placement
from tiercache.integrations.capture import Capture, CaptureFailed
from tiercache.results import Match, StopReason
from tiercache.buffers import device_buffers
from tiercache.integrations.hf_cache import Cache, CacheSpec, DynamicCache, Staging, UnsupportedCache
from tiercache.integrations.stores import StoreQueue
from tiercache.layout import Layout

__all__ = ["AdapterConfig", "CacheSpec", "Connection", "HybridCacheAdapter", "Prefill",
           "Restored", "UnsupportedCache", "device_buffers"]

log = logging.getLogger("tiercache.integrations")


@dataclass(frozen=True)
class _Set:
    """One of the two sets of staging rows and slots: a call uses one while the store of
    the call before it may still read the other."""

    base: int  # its first row: row base + p holds page p + 1 of the prompt
    rows: range
    load_slot: int
    store_slots: tuple[int, ...]


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
              checkpoints: Mapping[int, int] | None = None, first_page: int = 0) -> StoreResult: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class AdapterConfig:
    model_id: str  # names the weights: bytes of two different checkpoints must never mix
    page_tokens: int = 16
    max_tokens: int = 8192  # the longest prefix cached; sizes the staging rows
    checkpoint_every: int | None = None  # pages between extra checkpoints during prefill
    # Checkpoint the prompt's last full page and the page before its last token (as far
    # as a repeat of it loads), and the branch point. Each costs a slot's bytes in the
    # store, not a forward pass (unless the model's kernels cannot be segmented).
    checkpoint_ends: bool = True
    checkpoint_branches: bool = True
    max_checkpoints: int = 8  # per prefill: ends first, then the branch point, then the deepest
    one_pass: bool = True  # False: one forward pass per checkpoint, as without segmentable kernels
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
        if self.max_checkpoints < 1:
            raise InvalidArgument(f"max_checkpoints must be at least 1, got {self.max_checkpoints}")

    @property
    def max_pages(self) -> int:
        return self.max_tokens // self.page_tokens

    @property
    def rows(self) -> int:
        """Staging rows of the layout: two sets of max_pages (see _Set)."""
        return 2 * self.max_pages

    @property
    def slots(self) -> int:
        """State slots of the layout: two sets of one for loads and max_checkpoints for stores."""
        return 2 * (1 + self.max_checkpoints)


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
    checkpoints: tuple[int, ...]  # page counts whose state this prefill stores
    store: Future | None  # the store running behind (StoreResult), None if nothing was new

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
        expected = spec.layout(config.page_tokens, config.rows, config.slots)
        if worker.layout != expected:
            raise InvalidArgument("the worker was registered with another layout than this cache's: "
                                  "register spec.layout(page_tokens, config.rows, config.slots)")
        self.worker = worker
        self.spec = spec
        self.config = config
        self.new_cache = new_cache
        self.device = torch.device(device)
        self.layout = worker.layout
        self.staging = Staging(spec, config.page_tokens, worker.paged, worker.slots)
        self.stores = StoreQueue(self.device)
        pages, checkpoints = config.max_pages, config.max_checkpoints
        self._sets = [_Set(n * pages, range(n * pages, (n + 1) * pages), n * (1 + checkpoints),
                           tuple(range(n * (1 + checkpoints) + 1, (n + 1) * (1 + checkpoints))))
                      for n in range(2)]
        self._turn = 0
        # (step, seconds) of each step of the last prefill, once set to a list (benchmarks'
        # per-step breakdown): every mark waits for the GPU, so leave it None otherwise.
        self.profile: list[tuple[str, float]] | None = None
        self._captures: dict[int, tuple[torch.nn.Module, Capture | None]] = {}

    @classmethod
    def for_model(cls, model: torch.nn.Module, cache: Client | EmbeddedClient | Engine,
                  config: AdapterConfig) -> "HybridCacheAdapter":
        """An adapter for `model`'s own cache (`DynamicCache(config=model.config)`), registered
        with `cache`. A model on a GPU gets staging rows on its GPU (CUDA IPC to a daemon)."""
        def new_cache() -> Cache:
            return DynamicCache(config=model.config)
        spec = CacheSpec.probe(model, new_cache)
        device = next(model.parameters()).device
        layout = spec.layout(config.page_tokens, config.rows, config.slots)
        client = EmbeddedClient(cache) if isinstance(cache, Engine) else cache
        buffers = device_buffers(layout, device) if device.type == "cuda" else None
        worker = client.register(config.model_id, layout, extra_keys=config.extra, buffers=buffers)
        adapter = cls(worker, spec, config, new_cache, device)
        if config.one_pass:
            adapter.capture_for(model)  # tried now, not inside the first prefill
        return adapter

    def flush(self) -> None:
        """Wait for the stores in flight."""
        self.stores.flush()

    def close(self) -> None:
        """Wait for the stores in flight, then end the registration (a daemon unmaps the rows)."""
        self.stores.close()
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

    def _store_call(self, keys: list[PageKey], base: int, checkpoints: Mapping[int, int],
                    first: int = 0) -> Callable[[], StoreResult | None]:
        """The store of rows base.. as the pages of `keys` and {pages: slot} as checkpoints,
        sending only pages first+1.. (Worker.store's first_page). A checkpoint goes with the prefix it ends, in a call of its own:
        tiercache's admission keeps the one at the end of each call's keys (and declines
        others it does not expect reuse at), and these are the ones the adapter chose."""
        page = self.config.page_tokens
        calls = [(pages, {pages * page: slot}) for pages, slot in sorted(checkpoints.items())]
        if len(keys) > first and len(keys) not in checkpoints:
            calls.append((len(keys), {}))

        def store() -> StoreResult | None:
            total = None
            for end, offered in calls:
                rows = range(base + first, base + end) if self.layout.needs_pages else ()
                result = self.worker.store(keys=keys[first:end], kv_rows=rows,
                                           checkpoints=offered or None, first_page=first)
                total = result if total is None else total + result
            return total
        return store

    # -- the cache side ------------------------------------------------------------------
    def load(self, tokens: Any) -> Restored:
        """A cache that has seen the longest cached prefix of `tokens` (an empty cache on a
        miss). To get logits for the last token, pass all tokens but the last one."""
        return self._restore(self.keys(tokens), self._next_set())

    def _next_set(self) -> _Set:
        """The set the call before last used, once the stores that read it are done."""
        chosen = self._sets[self._turn]
        self._turn ^= 1
        self.stores.wait_for(chosen.rows, (chosen.load_slot, *chosen.store_slots))
        return chosen

    def _restore(self, keys: list[PageKey], buffers: _Set) -> Restored:
        """One Load call, then the cache made from the rows it filled."""
        if not keys:
            return Restored(self.new_cache(), 0, LoadResult(_MISS, {}, 0))
        rows = buffers.rows[:len(keys)] if self.layout.needs_pages else range(0)
        slot = buffers.load_slot if self.layout.needs_checkpoint else None
        result = self.worker.load(keys=keys, kv_rows=rows, slot=slot)
        self._mark("load (one call)")
        cache = self.new_cache()
        if result.match.pages:
            self.staging.fill(cache, result.match.pages, buffers.load_slot, self.device,
                              buffers.base)
        self._mark("rebuild the cache")
        return Restored(cache, result.match.tokens, result)

    def _mark(self, step: str) -> None:
        if self.profile is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.profile.append((step, time.perf_counter()))

    def store(self, tokens: Any, cache: Cache) -> StoreResult | None:
        """Store the KV pages of a cache that has seen exactly `tokens` and, if their count
        is a multiple of page_tokens, its state as the checkpoint of the last page (a state
        after a partial page is no checkpoint at all). Waits for it; None when `tokens` has
        no full page."""
        tokens = _flat(tokens)
        self._check_length(cache, len(tokens))
        keys = self.keys(tokens)
        buffers = self._next_set()
        wanted = {}
        if len(tokens) == len(keys) * self.config.page_tokens and self.layout.needs_checkpoint:
            wanted = {len(keys): buffers.store_slots[0]}
            self.staging.state_from(cache, buffers.store_slots[0])
        self.staging.pages_from(cache, 0, len(keys), buffers.base)
        return self.stores.submit(self._store_call(keys, buffers.base, wanted), buffers.rows,
                                  wanted.values()).result()

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
        """Load the longest hit of `input_ids` ([1, N]), compute the rest keeping the states
        at the planned boundaries, and store pages and checkpoints behind the return. With
        `last_only`, only the last token's logits are computed (`logits_to_keep=1`): a
        long prompt's logits would take more memory than its cache."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise InvalidArgument(
                f"input_ids must have shape [1, tokens], got {tuple(input_ids.shape)}")
        length, page = input_ids.shape[1], self.config.page_tokens
        keys = self.keys(input_ids[0])
        if self.profile is not None:
            self.profile.clear()
        self._mark("start")
        buffers = self._next_set()
        self._mark("wait for a set of rows")
        # At least one token is left to compute: its logits pick the next token.
        restored = self._restore(keys[:(length - 1) // page], buffers)
        loaded = restored.load.match.pages
        wanted = self.plan(restored.tokens, restored.load.match.kv_pages, length, len(keys))
        slots = dict(zip(wanted, buffers.store_slots))
        passes = self._compute(model, input_ids, restored, slots, last_only)
        self._mark("forward pass(es), states kept")
        self.staging.pages_from(restored.cache, loaded, len(keys), buffers.base)
        self._mark("copy new pages to staging")
        store = None
        if len(keys) > loaded or slots:
            # from the hit's last page on: cached already, it anchors the new pages
            store = self.stores.submit(self._store_call(keys, buffers.base, slots,
                                                        max(loaded - 1, 0)),
                                       buffers.rows, slots.values())
        self._mark("hand the store over")
        logits = passes[-1][1] if last_only else torch.cat([lg for _, lg in passes], dim=1)
        return Prefill(restored.cache, logits, restored.tokens, tuple(n for n, _ in passes),
                       restored.load, tuple(wanted), store)

    def _compute(self, model: torch.nn.Module, input_ids: torch.Tensor, restored: Restored,
                 slots: dict[int, int], last_only: bool) -> list[tuple[int, torch.Tensor]]:
        """Run `model` over the tokens after the hit; the state after each page count of
        `slots` ends in its slot. One pass with a capture, else one pass per boundary.
        Returns (tokens, logits) of each pass."""
        cache, done, length = restored.cache, restored.tokens, input_ids.shape[1]
        page, extra = self.config.page_tokens, {"logits_to_keep": 1} if last_only else {}
        ends = {pages * page: slot for pages, slot in slots.items()}
        capture = self.capture_for(model) if self.config.one_pass else None
        if capture is None:
            stops = sorted(set(ends) | {length})
        else:
            stops = [length]
        passes = []
        for end in stops:
            cuts = {at - done: ends[at] for at in ends if done < at < end}
            keep = (lambda cut, layer, kind, state:
                    self.staging.keep_state(cuts[cut], layer, kind, state))
            scope = capture.during(cache, end - done, list(cuts), keep) if cuts else nullcontext()
            with scope:
                out = model(input_ids=input_ids[:, done:end], past_key_values=cache,
                            use_cache=True, **extra)
            passes.append((end - done, out.logits))
            done = end
            if end in ends:  # the state is exactly at this page boundary now
                self.staging.state_from(cache, ends[end])
        return passes

    def capture_for(self, model: torch.nn.Module) -> Capture | None:
        """The model's capture, tried once on two tokens; None (and a log line) if its
        linear-attention kernels cannot run in segments."""
        if id(model) in self._captures and self._captures[id(model)][0] is model:
            return self._captures[id(model)][1]
        layers = sorted({s.layer for s in self.spec.states})
        capture = Capture.of(model, layers) if layers else None
        if any(s.index for s in self.spec.states):
            capture = None  # layers with several states: not segmented
        if capture is not None:
            try:
                probe = self.new_cache()
                ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
                with capture.during(probe, 2, [1], lambda *_: None):
                    model(input_ids=ids, past_key_values=probe, use_cache=True)
            except CaptureFailed as error:
                log.warning("checkpoint capture failed on %s (%s)", type(model).__name__, error)
                capture = None
        if capture is None and layers:
            log.warning("%s: its linear-attention kernels cannot be run in segments; each "
                        "checkpoint inside a prefill costs a forward pass of its own",
                        type(model).__name__)
        self._captures[id(model)] = (model, capture)
        return capture

    def plan(self, done: int, branch: int, length: int, pages: int) -> list[int]:
        """The page counts whose state a prefill keeps (`placement.plan`); none without
        linear-attention state."""
        if not self.layout.needs_checkpoint:
            return []
        return placement.plan(self.config, done, branch, length, pages)


def _flat(tokens: Any) -> Any:
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.shape[0] == 1:
        return tokens[0]
    return tokens
