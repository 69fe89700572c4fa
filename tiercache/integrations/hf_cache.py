"""A Hugging Face transformers cache seen as tiercache rows, and back.

transformers 5.x builds the cache of every hybrid model in the library from the same
layer classes (`DynamicCache(config=...)` picks them from `config.layer_types`):

- `DynamicLayer`: full attention, `keys` / `values` of shape [batch, heads, tokens, dim];
- `LinearAttentionLayer`: GDN / Mamba / short-conv layers, `conv_states[i]` and
  `recurrent_states[i]` (fixed shapes, no token dimension), `i < number_of_states`;
- `LinearAttentionAndFullAttentionLayer`: both in one layer (Falcon-H1, Zamba);
- `DummyLayer`: a layer that caches nothing (MLP-only layers, KV-sharing consumers).

This module relies on those public attributes only, never on a model's own code, so
every family built from these classes is covered. Layers that keep less than the whole
prefix (sliding windows, quantized or indexed KV) cannot be rebuilt from pages and are
refused by name.

Rows: each full-attention layer gives two paged buffers, `layer{i}.k` and `layer{i}.v`,
whose row p is page p+1 of the sequence, shaped [heads, page_tokens, dim] like the
cache's own tensors; each linear-attention state gives one slot buffer,
`layer{i}.conv{s}` or `layer{i}.recurrent{s}`, whose row is that state of one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from tiercache.errors import InvalidArgument
from tiercache.layout import BufferSpec, Layout

try:
    from transformers import cache_utils
    from transformers.cache_utils import (
        Cache, CacheLayerMixin, DynamicCache, DynamicLayer, LinearAttentionAndFullAttentionLayer,
        LinearAttentionCacheLayerMixin)
except ImportError as error:  # transformers missing, or a version without linear-attention layers
    raise ImportError(
        "tiercache.integrations.transformers needs Hugging Face transformers 5.x with its "
        "linear-attention cache layers (tested with 5.17 and 5.23): "
        "pip install 'tiercache[transformers]'") from error

# Layers that cache nothing (MLP-only layers); transformers before 5.23 has none (GPU images
# still ship 5.17).
_EMPTY_LAYERS = tuple(getattr(cache_utils, name) for name in ("DummyLayer",)
                      if hasattr(cache_utils, name))

# Layers whose KV tensors hold every token of the prefix, so pages rebuild them exactly.
_WHOLE_KV_LAYERS = (DynamicLayer, LinearAttentionAndFullAttentionLayer)
_STATE_KINDS = ("conv", "recurrent")


class UnsupportedCache(InvalidArgument):
    """A cache layer the adapter cannot page; the message names it."""


@dataclass(frozen=True)
class KVSpec:
    layer: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype


@dataclass(frozen=True)
class StateSpec:
    layer: int
    index: int  # the layer's state_idx
    kind: str  # "conv" or "recurrent"
    shape: tuple[int, ...]  # without the batch dimension
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return f"layer{self.layer}.{self.kind}{self.index}"


@dataclass(frozen=True)
class CacheSpec:
    """What a model's cache holds per layer: the shapes, not the contents."""

    kv: tuple[KVSpec, ...]
    states: tuple[StateSpec, ...]

    @classmethod
    def of(cls, cache: Cache) -> "CacheSpec":
        """The spec of a cache that has seen at least one token (layers fill lazily)."""
        kv: list[KVSpec] = []
        states: list[StateSpec] = []
        for index, layer in enumerate(cache.layers):
            layer_kv, layer_states = _read_layer(index, layer)
            kv += layer_kv
            states += layer_states
        if not kv and not states:
            raise UnsupportedCache("the cache holds no tensors: run one forward pass with it first")
        return cls(tuple(kv), tuple(states))

    @classmethod
    def probe(cls, model: torch.nn.Module, new_cache: Callable[[], Cache]) -> "CacheSpec":
        """Run `model` on one token with a fresh cache and read the spec off it: linear-attention
        shapes (conv kernel, state size) are only known to the model's own code."""
        cache = new_cache()
        device = next(model.parameters()).device
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
                  past_key_values=cache, use_cache=True)
        return cls.of(cache)

    def layout(self, page_tokens: int, pages: int, slots: int = 1) -> Layout:
        paged = []
        for kv in self.kv:
            for part, dim in (("k", kv.key_dim), ("v", kv.value_dim)):
                paged.append(BufferSpec(f"layer{kv.layer}.{part}", pages,
                                        (kv.heads, page_tokens, dim), kv.dtype))
        return Layout(page_tokens, tuple(paged),
                      tuple(BufferSpec(s.name, slots, s.shape, s.dtype) for s in self.states))


def _read_layer(index: int, layer: object) -> tuple[list[KVSpec], list[StateSpec]]:
    where = f"cache layer {index} ({type(layer).__name__})"
    if isinstance(layer, _EMPTY_LAYERS):
        return [], []
    linear = isinstance(layer, LinearAttentionCacheLayerMixin)
    if not linear and not isinstance(layer, CacheLayerMixin):
        raise UnsupportedCache(f"{where} is not a transformers cache layer")
    states: list[StateSpec] = []
    if linear:
        if layer.record_past:  # conv states then keep more than the kernel width
            raise UnsupportedCache(f"{where} records past states: store before "
                                   "activate_past_recording()")
        for s in range(layer.number_of_states):
            for kind in _STATE_KINDS:
                if getattr(layer, f"is_{kind}_states_initialized")[s]:
                    tensor = _one_sequence(getattr(layer, f"{kind}_states")[s], where)
                    states.append(StateSpec(index, s, kind, tuple(tensor.shape[1:]), tensor.dtype))
    kv: list[KVSpec] = []
    if isinstance(layer, CacheLayerMixin):
        if type(layer) not in _WHOLE_KV_LAYERS:
            supported = [c.__name__ for c in _WHOLE_KV_LAYERS]
            raise UnsupportedCache(f"{where} does not keep every token's keys and values, so "
                                   f"pages cannot rebuild it; supported: {supported}")
        if not layer.is_initialized:
            raise UnsupportedCache(f"{where} is empty: run one forward pass with the cache first")
        keys = _one_sequence(layer.keys, where)
        kv.append(KVSpec(index, keys.shape[1], keys.shape[3], layer.values.shape[3], keys.dtype))
    return kv, states


def _one_sequence(tensor: torch.Tensor, where: str) -> torch.Tensor:
    if tensor.shape[0] != 1:
        raise UnsupportedCache(f"{where} holds a batch of {tensor.shape[0]} sequences: the adapter "
                               "caches one sequence at a time (batch size 1)")
    return tensor


class Staging:
    """The adapter's rows: a registered worker's buffers (shared memory the daemon maps, CUDA
    memory it opens by IPC, or plain tensors for an engine in-process), holding the KV pages
    of one sequence (row base + p = page p+1: the adapter keeps two sets of rows, see
    transformers._Set) and state slots. tiercache copies between these and its tiers; this
    class copies between these and a transformers cache."""

    def __init__(self, spec: CacheSpec, page_tokens: int, paged: Mapping[str, torch.Tensor],
                 slots: Mapping[str, torch.Tensor]) -> None:
        self.spec = spec
        self.page_tokens = page_tokens
        self.paged = dict(paged)
        self.slots = dict(slots)

    def pages_from(self, cache: Cache, first: int, last: int, base: int = 0) -> None:
        """Copy pages first+1..last of the cache's KV into rows base+first..base+last-1."""
        if last <= first:
            return
        span = slice(first * self.page_tokens, last * self.page_tokens)
        for kv in self.spec.kv:
            layer = cache.layers[kv.layer]
            for part, tensor in (("k", layer.keys), ("v", layer.values)):
                pages = tensor[0, :, span].unflatten(1, (last - first, self.page_tokens))
                rows = self.paged[f"layer{kv.layer}.{part}"][base + first:base + last]
                rows.copy_(pages.transpose(0, 1))

    def state_from(self, cache: Cache, slot: int) -> None:
        """Copy the cache's linear-attention states into `slot`."""
        for s in self.spec.states:
            tensors = getattr(cache.layers[s.layer], f"{s.kind}_states")
            self.slots[s.name][slot].copy_(tensors[s.index][0])

    def keep_state(self, slot: int, layer: int, kind: str, state: torch.Tensor) -> None:
        """Copy one layer's state (with its batch dimension) into `slot`."""
        self.slots[f"layer{layer}.{kind}0"][slot].copy_(state[0])

    def fill(self, cache: Cache, pages: int, slot: int, device: torch.device, base: int = 0) -> None:
        """Make an empty cache hold rows base..base+pages-1 and `slot`: each tensor of the
        cache is made once, by one copy out of the rows (the rows may then be reused)."""
        tokens = pages * self.page_tokens
        for kv in self.spec.kv:
            layer = cache.layers[kv.layer]
            parts = []
            for part, dim in (("k", kv.key_dim), ("v", kv.value_dim)):
                tensor = torch.empty((1, kv.heads, tokens, dim), dtype=kv.dtype, device=device)
                rows = self.paged[f"layer{kv.layer}.{part}"][base:base + pages]  # [pages, heads, page, dim]
                tensor[0].view(kv.heads, pages, self.page_tokens, dim).copy_(rows.transpose(0, 1))
                parts.append(tensor)
            layer.lazy_initialization(*parts)
            layer.keys, layer.values = parts
        for s in self.spec.states:
            layer = cache.layers[s.layer]
            state = self.slots[s.name][slot].unsqueeze(0)
            if s.kind == "conv":
                layer.lazy_initialization(conv_states=state, state_idx=s.index,
                                          conv_kernel_size=state.shape[-1])
            else:
                layer.lazy_initialization(recurrent_states=state, state_idx=s.index)
            getattr(layer, f"{s.kind}_states")[s.index].copy_(state)
            layer.has_previous_state[s.index] = True  # the next pass continues these states

