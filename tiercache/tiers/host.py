"""The host tier: a slot arena in host memory, page-locked when CUDA is available."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tiercache.tiers.arena import MIN_SLOT_BYTES, SlotArena

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class HostConfig:
    budget_bytes: int = 4 * GiB
    slab_bytes: int = 64 * MiB
    pin: bool | None = None  # None: page-locked when CUDA is available
    min_slot_bytes: int = MIN_SLOT_BYTES  # tiny entries are charged this much


class HostMemory:
    """Slabs of exactly the asked size. Page-locked ones come from cudaHostAlloc: GPU
    kernels read and write it at 0.92-0.95 of PCIe bandwidth, where memory page-locked
    after the fact (cudaHostRegister) reached 0.80 (H200, 2026-11-21), and torch's
    pinned allocator would round every slab up to a power of two."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._pointers: dict[int, int] = {}  # data_ptr -> what cudaFreeHost takes
        self._chunk_bytes = 0
        self._chunks: list[int] = []  # page-locked chunks allocated ahead, free to hand out
        self._from_chunks: set[int] = set()  # slabs that are such chunks

    def prefault(self, chunks: int, chunk_bytes: int) -> None:
        """Allocate page-locked chunks ahead (when the daemon starts), so that no store
        waits for cudaHostAlloc or for the pages of a new slab to be faulted in."""
        self._chunk_bytes = chunk_bytes
        self._chunks += [self._host_alloc(chunk_bytes) for _ in range(chunks)]

    def allocate(self, slots: int, slot_bytes: int) -> torch.Tensor:
        nbytes = slots * slot_bytes
        if not self.pin:
            return torch.empty((slots, slot_bytes), dtype=torch.uint8)
        if self._chunks and nbytes <= self._chunk_bytes:
            pointer = self._chunks.pop()
            self._from_chunks.add(pointer)
        else:
            pointer = self._host_alloc(nbytes)
        memory = (ctypes.c_uint8 * nbytes).from_address(pointer)
        slab = torch.frombuffer(memory, dtype=torch.uint8).view(slots, slot_bytes)
        self._pointers[slab.data_ptr()] = pointer
        return slab

    @staticmethod
    def _host_alloc(nbytes: int) -> int:
        from cuda.bindings import runtime
        status, pointer = runtime.cudaHostAlloc(nbytes, runtime.cudaHostAllocPortable
                                                | runtime.cudaHostAllocMapped)
        if int(status) != 0:
            raise MemoryError(f"cudaHostAlloc of {nbytes} bytes failed ({status!r}): lower the "
                              "host budget or raise the memlock limit")
        return int(pointer)

    def release(self, slab: torch.Tensor) -> None:
        if not self.pin:
            return
        pointer = self._pointers.pop(slab.data_ptr())
        if pointer in self._from_chunks:  # back to the chunks: pinned memory is slow to get
            self._from_chunks.discard(pointer)
            self._chunks.append(pointer)
            return
        from cuda.bindings import runtime
        runtime.cudaFreeHost(pointer)

    def close(self) -> None:
        if self._chunks:
            from cuda.bindings import runtime
            for pointer in self._chunks:
                runtime.cudaFreeHost(pointer)
            self._chunks = []


def host_arena(config: HostConfig) -> SlotArena:
    pin = torch.cuda.is_available() if config.pin is None else config.pin
    # Small budgets get small slabs, so that room moves between entry sizes easily.
    slab_bytes = max(1, min(config.slab_bytes, config.budget_bytes // 4))
    memory = HostMemory(pin)
    if pin:  # page-locked memory is slow to allocate: all of it now, not inside a store
        memory.prefault(config.budget_bytes // slab_bytes, slab_bytes)
    return SlotArena(config.budget_bytes, slab_bytes, memory, config.min_slot_bytes)
