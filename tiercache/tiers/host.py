"""The host tier: a slot arena in host memory, page-locked when CUDA is available."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiercache.tiers.arena import SlotArena

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class HostConfig:
    budget_bytes: int = 4 * GiB
    slab_bytes: int = 64 * MiB
    pin: bool | None = None  # None: page-locked when CUDA is available


class HostMemory:
    """Allocates slabs of exactly the asked size and page-locks them with cudaHostRegister
    (torch's pinned allocator would round every slab up to a power of two)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin

    def allocate(self, slots: int, slot_bytes: int) -> torch.Tensor:
        slab = torch.empty((slots, slot_bytes), dtype=torch.uint8)
        if self.pin:
            check(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), 0))
        return slab

    def release(self, slab: torch.Tensor) -> None:
        if self.pin:
            check(torch.cuda.cudart().cudaHostUnregister(slab.data_ptr()))


def check(status: object) -> None:
    code = getattr(status, "value", status)
    if code != 0:
        raise RuntimeError(f"CUDA host registration failed with error {status}")


def host_arena(config: HostConfig) -> SlotArena:
    pin = torch.cuda.is_available() if config.pin is None else config.pin
    # Small budgets get small slabs, so that room moves between entry sizes easily.
    slab_bytes = max(1, min(config.slab_bytes, config.budget_bytes // 4))
    return SlotArena(config.budget_bytes, slab_bytes, HostMemory(pin))
