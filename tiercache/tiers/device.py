"""The device tier: a slot arena in GPU memory, owned by the daemon, on the GPU of the
workers it serves. Stores land here first (a device-to-device copy), so a worker's rows
are free again at once; the background thread copies each entry down to the host soon
after, so that evicting it from the device later costs nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tiercache.errors import InvalidArgument
from tiercache.tiers.arena import MIN_SLOT_BYTES, SlotArena

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceConfig:
    budget_bytes: int = 4 * GiB
    slab_bytes: int = 1 * GiB
    min_slot_bytes: int = MIN_SLOT_BYTES  # tiny entries are charged this much

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0 or self.slab_bytes <= 0:
            raise InvalidArgument("device budget_bytes and slab_bytes must be positive")


class DeviceMemory:
    """Slabs from torch's caching allocator, marked as used by the copy streams: a slab
    dropped while a copy on one of them may still touch it is not handed out again before
    that copy is done."""

    def __init__(self, device: torch.device, streams: Sequence[torch.cuda.Stream]) -> None:
        self.device = device
        self.streams = list(streams)

    def allocate(self, slots: int, slot_bytes: int) -> torch.Tensor:
        slab = torch.empty((slots, slot_bytes), dtype=torch.uint8, device=self.device)
        for stream in self.streams:
            slab.record_stream(stream)
        return slab

    def release(self, slab: torch.Tensor) -> None:
        pass  # torch's allocator takes it back when the last view goes

    def close(self) -> None:
        pass


def device_arena(config: DeviceConfig, device: torch.device,
                 streams: Sequence[torch.cuda.Stream] = ()) -> SlotArena:
    """The device tier's arena; `streams` are those its slots are copied on."""
    slab_bytes = max(1, min(config.slab_bytes, config.budget_bytes // 4))
    # the budget through torch's caching allocator once, now: slabs come from its cache
    # later, never from a cudaMalloc inside a store
    torch.empty(config.budget_bytes, dtype=torch.uint8, device=device)
    return SlotArena(config.budget_bytes, slab_bytes, DeviceMemory(device, streams),
                     config.min_slot_bytes)
