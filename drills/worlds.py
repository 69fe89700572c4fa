"""Small worlds for engine tests: a hybrid layout, random worker buffers, prompts."""

from __future__ import annotations

import numpy as np
import torch

from tiercache.buffers import WorkerBuffers
from tiercache.hashing import Namespace, page_keys
from tiercache.layout import BufferSpec, Layout

PAGE_TOKENS = 16


def hybrid_layout(page_rows=64, slot_rows=8, paged=4, slots=2, page_tokens=PAGE_TOKENS) -> Layout:
    return Layout(
        page_tokens,
        paged=tuple(BufferSpec(f"kv{i}", page_rows, (page_tokens, 2, 8), "bfloat16") for i in range(paged)),
        slots=tuple(BufferSpec(f"state{i}", slot_rows, (4, 8, 8) if i % 2 else (24, 3),
                               "float32" if i % 2 else "bfloat16") for i in range(slots)))


def random_buffers(layout: Layout, seed: int) -> WorkerBuffers:
    """Worker buffers full of random bytes (never zeros: they would hide unwritten rows)."""
    gen = torch.Generator().manual_seed(seed)

    def tensor(spec):
        raw = torch.randint(0, 256, (spec.rows, spec.row_bytes), dtype=torch.uint8, generator=gen)
        return raw.view(getattr(torch, spec.dtype)).view(spec.shape)
    return WorkerBuffers.bind(layout, [tensor(s) for s in layout.paged], [tensor(s) for s in layout.slots])


def prompt_keys(layout: Layout, seed: int, pages: int, prefix: list[int] | None = None):
    """Keys of a random prompt of `pages` full pages (after `prefix` tokens, if given)."""
    tokens = list(prefix or []) + np.random.default_rng(seed).integers(
        0, 150_000, pages * layout.page_tokens).tolist()
    return page_keys(tokens, Namespace("test-model", layout.fingerprint).root(), layout.page_tokens)


def page_bytes(buffers: WorkerBuffers, rows) -> list[torch.Tensor]:
    index = torch.as_tensor(np.asarray(list(rows), np.int64))  # numpy ints one by one are slow
    return [b[index].clone() for b in buffers.paged]


def slot_bytes(buffers: WorkerBuffers, slot: int) -> list[torch.Tensor]:
    return [b[slot].clone() for b in buffers.slots]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def cpu_device_tier(engine, budget_bytes: int, slab_bytes: int):
    """Give `engine` a device tier in CPU memory (the same SlotArena and copy path between
    arenas as a GPU's), with CPU workers taken to be on its device: the device tier's
    logic without a GPU. Returns the engine."""
    from tiercache.tiers.arena import SlotArena
    from tiercache.tiers.device import DeviceMemory
    engine.books.attach_device(SlotArena(budget_bytes, slab_bytes, DeviceMemory(torch.device("cpu"), ())))
    engine.mover.device_transfer = engine.transfer
    return engine
