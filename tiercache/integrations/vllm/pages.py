"""vLLM's KV cache as rows of bytes: one tiercache layout per KV cache group.

vLLM (0.32) keeps the whole KV cache of a worker in one backing allocation. Each cache
group (the full-attention layers; each group of Mamba/GDN layers) views that allocation
from byte 0: groups alias, which is sound because a block id belongs to one group at a
time. `KVCacheConfig.kv_cache_tensors` says where everything is: layer `l` of a tensor
has its page for block `b` at `offset + l * layer_stride + b * block_stride`.

- Layer-outer layouts (`LBNHC`, ...): every layer owns a region of `num_blocks` pages,
  so each layer is a buffer whose rows are its pages (`block_stride` bytes apart).
- Block-outer layouts (`BLHNC`, ...): block `b` is one run of `block_stride` bytes that
  holds the page of every layer of the group that owns it, so the group has one buffer
  whose rows are whole blocks.

A group becomes a registration: attention groups as paged buffers (a row = the KV page
of one block), Mamba groups as slot buffers (a row = the state a block holds, slot id =
block id). The page size is vLLM's block size. Names are the layer names, so two Mamba
groups never share a namespace. Nothing here imports vLLM: `connector` converts its
KVCacheConfig, and the GPU tests build the same shapes without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from tiercache.errors import InvalidArgument
from tiercache.layout import BufferSpec, Layout

ATTENTION = "attention"  # KV pages, written once per block and appended to
MAMBA = "mamba"  # recurrent state, one block per state at a block boundary


@dataclass(frozen=True)
class CacheGroup:
    index: int  # vLLM's KV cache group id
    kind: str  # ATTENTION or MAMBA
    layers: tuple[str, ...]
    block_size: int  # tokens per block


@dataclass(frozen=True)
class Placement:
    """vLLM's KVCacheTensor: where some layers' pages lie in the backing allocation."""

    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0


@dataclass(frozen=True)
class CacheShape:
    num_blocks: int
    nbytes: int  # of the backing allocation
    groups: tuple[CacheGroup, ...]
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.nbytes <= 0:
            raise InvalidArgument(f"a KV cache of {self.num_blocks} blocks and {self.nbytes} "
                                  "bytes is empty")
        sizes = {g.block_size for g in self.groups}
        if len(sizes) != 1:
            raise InvalidArgument(f"KV cache groups have block sizes {sorted(sizes)}: tiercache "
                                  "needs one (vLLM aligns them in --mamba-cache-mode align)")

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size


@dataclass(frozen=True)
class Run:
    """One buffer of a member: `rows` rows of `row_bytes`, from `offset` in the backing."""

    offset: int
    row_bytes: int


@dataclass(frozen=True)
class MemberPlan:
    """One cache group of one TP rank as a tiercache registration."""

    group: CacheGroup
    layout: Layout
    runs: dict[str, Run]  # buffer name -> where it lies


def group_runs(shape: CacheShape, group: CacheGroup) -> dict[str, Run]:
    """The buffers of one cache group, by name (see the module doc)."""
    mine = [p for p in shape.placements if set(p.layers) & set(group.layers)]
    if not mine:
        raise InvalidArgument(f"no KV cache tensor holds the layers of cache group {group.index}")
    runs: dict[str, Run] = {}
    block_strides = set()  # of block-outer tensors: a block of the group is one run
    for placement in mine:
        if not set(placement.layers) <= set(group.layers):
            raise InvalidArgument(f"a KV cache tensor mixes layers of cache group {group.index} "
                                  f"with others ({list(placement.layers)}): not a layout vLLM makes")
        if placement.layer_stride >= placement.block_stride * shape.num_blocks:  # layer-outer
            for i, layer in enumerate(placement.layers):
                runs[layer] = Run(placement.offset + i * placement.layer_stride,
                                  placement.block_stride)
        else:
            block_strides.add(placement.block_stride)
    if block_strides:
        if runs or len(block_strides) > 1:
            raise InvalidArgument(f"cache group {group.index} mixes layer-outer and block-outer "
                                  "tensors, or block strides: not a layout vLLM makes")
        runs[",".join(group.layers)] = Run(0, block_strides.pop())
    for name, run in runs.items():
        if run.offset < 0 or run.offset + run.row_bytes * shape.num_blocks > shape.nbytes:
            raise InvalidArgument(f"buffer {name!r} runs past the end of the KV cache "
                                  f"({shape.nbytes} bytes)")
    return runs


def member_plans(shape: CacheShape, tp_rank: int, tp_size: int) -> list[MemberPlan]:
    """One registration per cache group of this rank, in group order."""
    plans = []
    for group in shape.groups:
        runs = group_runs(shape, group)
        specs = tuple(BufferSpec(name, shape.num_blocks, (run.row_bytes,), "uint8")
                      for name, run in runs.items())
        paged, slots = (specs, ()) if group.kind == ATTENTION else ((), specs)
        layout = Layout(shape.block_size, paged=paged, slots=slots, tp_rank=tp_rank,
                        tp_size=tp_size)
        plans.append(MemberPlan(group, layout, runs))
    return plans


def member_tensors(backing: torch.Tensor, plan: MemberPlan, num_blocks: int
                   ) -> dict[str, torch.Tensor]:
    """The member's buffers as views into the flat uint8 backing tensor."""
    return {name: backing[run.offset:run.offset + run.row_bytes * num_blocks]
            .view(num_blocks, run.row_bytes) for name, run in plan.runs.items()}


def backing_of(shape: CacheShape, kv_caches: Mapping[str, Any]) -> torch.Tensor:
    """The backing allocation under vLLM's per-layer views, as a flat uint8 tensor, after
    checking that every layer starts where the shape says (so the rows are right)."""
    first = _tensors(next(iter(kv_caches.values())))[0]
    storage = first.untyped_storage()
    if storage.nbytes() < shape.nbytes:
        raise InvalidArgument(f"vLLM's KV cache storage holds {storage.nbytes()} bytes, its "
                              f"KVCacheConfig says {shape.nbytes}: not one backing allocation")
    backing = torch.empty(0, dtype=torch.uint8, device=first.device)
    backing.set_(storage, 0, (shape.nbytes,), (1,))
    base = storage.data_ptr()
    for placement in shape.placements:
        for i, layer in enumerate(placement.layers):
            if layer not in kv_caches:
                continue  # vLLM passes the layers this worker runs
            views = _tensors(kv_caches[layer])
            start = min(v.data_ptr() for v in views) - base
            expected = placement.offset + i * placement.layer_stride
            if any(v.untyped_storage().data_ptr() != base for v in views) or start != expected:
                raise InvalidArgument(f"vLLM's view of layer {layer!r} starts at byte {start} of "
                                      f"another allocation or offset (expected {expected}): this "
                                      "vLLM lays its KV cache out in a way tiercache does not know")
    return backing


def _tensors(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (list, tuple)) else [value]
