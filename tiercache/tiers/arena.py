"""Fixed-size slots under one byte budget, on any torch device.

Each entry size gets its own pool of slots, carved from slabs that are allocated as
stores need them. Allocation and free are O(1) (a free-list stack per pool). A slab goes
back to the budget only when all its slots are free, which `reclaim` does on demand when
another pool needs room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np
import torch

# What a slot of the memory tiers takes at least: the entries a budget holds, and the index
# rows (about 110 bytes each) that keep their books, stay below budget / 1 KiB.
MIN_SLOT_BYTES = 1024


class Memory(Protocol):
    """Where slabs come from: host (maybe page-locked) or device memory."""

    def allocate(self, slots: int, slot_bytes: int) -> torch.Tensor:
        """A uint8 tensor [slots, slot_bytes]."""

    def release(self, slab: torch.Tensor) -> None:
        """Called once before a slab is dropped."""

    def close(self) -> None:
        """Give back what is kept for later slabs."""


@dataclass(frozen=True)
class SlabPart:
    """The part of a slot list that lies in one slab."""

    slab: torch.Tensor  # uint8 [slots_per_slab, slot_bytes], rows `stride` bytes apart
    local: np.ndarray  # slot indices inside the slab
    positions: np.ndarray  # where these slots stand in the caller's list

    def addresses(self) -> np.ndarray:
        """The address of each slot's bytes (int64)."""
        return self.slab.data_ptr() + self.local.astype(np.int64) * self.slab.stride(0)


class SlotPool:
    """Slots of one entry size. A slot is `stride` bytes apart from the next (at least the
    entry size: tiny entries are charged a floor, so that the entries a budget can hold,
    and with them the bookkeeping, stay bounded). Slots never handed out cost nothing: a
    slab hands out its slots in order, and only returned ones go on the free stack."""

    def __init__(self, slot_bytes: int, slots_per_slab: int, stride: int | None = None) -> None:
        self.slot_bytes = slot_bytes
        self.stride = max(slot_bytes, stride or 0)
        self.slots_per_slab = slots_per_slab
        self.slabs: list[torch.Tensor | None] = []  # uint8 [slots, stride] each
        self._views: list[torch.Tensor | None] = []  # each slab's [slots, slot_bytes]
        self.fresh: list[int] = []  # per slab: slots never handed out start here
        self.free_slots: list[int] = []  # returned slots, a stack

    def add_slab(self, slab: torch.Tensor) -> None:
        number = next((i for i, s in enumerate(self.slabs) if s is None), len(self.slabs))
        if number == len(self.slabs):
            self.slabs.append(slab)
            self._views.append(None)
            self.fresh.append(0)
        else:
            self.slabs[number], self.fresh[number] = slab, 0
        self._views[number] = slab[:, :self.slot_bytes]

    def pop(self, count: int) -> list[int]:
        """Up to `count` free slots: returned ones first (the top of the stack), then
        slots never used, each kind in ascending order (a store's slots then lie in runs
        in the order of its keys: the copy engines take a run as one copy)."""
        taken = sorted(self.free_slots[-count:]) if count else []
        del self.free_slots[len(self.free_slots) - len(taken):]
        for number, slab in enumerate(self.slabs):
            if len(taken) == count:
                break
            if slab is None or self.fresh[number] == slab.shape[0]:
                continue
            start = self.fresh[number]
            end = min(slab.shape[0], start + count - len(taken))
            base = number * self.slots_per_slab
            taken.extend(range(base + start, base + end))
            self.fresh[number] = end
        return taken

    def push(self, slots: list[int]) -> None:
        self.free_slots.extend(slots)

    def release_empty(self) -> list[torch.Tensor]:
        """Take out the slabs with no slot in use (each slot it handed out is back on the
        free stack: counted here, not at every pop and push) and return them."""
        back = np.bincount(np.asarray(self.free_slots, np.int64) // self.slots_per_slab,
                           minlength=len(self.slabs))
        empty = {i for i, s in enumerate(self.slabs) if s is not None and back[i] == self.fresh[i]}
        released = []
        for i in empty:
            released.append(self.slabs[i])
            self.slabs[i] = self._views[i] = None
            self.fresh[i] = 0
        if empty:
            self.free_slots = [s for s in self.free_slots if s // self.slots_per_slab not in empty]
        return released

    def view(self, slot: int) -> torch.Tensor:
        """The entry's bytes in `slot` (slot_bytes of them)."""
        slab = self.slabs[slot // self.slots_per_slab]
        assert slab is not None, f"slot {slot} lies in a released slab"
        return slab[slot % self.slots_per_slab, :self.slot_bytes]

    def addresses(self, slots: np.ndarray) -> np.ndarray:
        """The address of each slot's bytes, in the order given (int64)."""
        out = np.empty(len(slots), np.int64)
        for part in self.parts(slots):
            out[part.positions] = part.addresses()
        return out

    def parts(self, slots: np.ndarray) -> Iterator[SlabPart]:
        """Split a list of slots by slab (usually one part), slabs in ascending order."""
        if not len(slots):
            return
        first, last = int(slots.min()) // self.slots_per_slab, int(slots.max()) // self.slots_per_slab
        if first == last:  # all in one slab, the usual case: no split, no sort
            view = self._views[first]
            assert view is not None, f"slots {slots} lie in a released slab"
            yield SlabPart(view, slots - first * self.slots_per_slab, np.arange(len(slots)))
            return
        numbers, local = np.divmod(slots, self.slots_per_slab)
        # slots in slab order (the usual case: taken in order) need no sort; otherwise one
        # sort for all slabs, not a pass over the list per slab
        order = None if np.all(numbers[1:] >= numbers[:-1]) else np.argsort(numbers, kind="stable")
        if order is not None:
            numbers, local = numbers[order], local[order]
        # all in one slab (the usual case) needs no pass over the slab boundaries
        inner = ([] if numbers[0] == numbers[-1]
                 else (np.flatnonzero(numbers[1:] != numbers[:-1]) + 1).tolist())
        bounds = [0, *inner, len(slots)]
        for number, start, end in zip(numbers[bounds[:-1]].tolist(), bounds[:-1], bounds[1:]):
            positions = np.arange(start, end) if order is None else order[start:end]
            view = self._views[number]
            assert view is not None, f"slots {slots[positions]} lie in a released slab"
            yield SlabPart(view, local[start:end], positions)


class SlotArena:
    """Pools of fixed-size slots sharing one byte budget."""

    def __init__(self, budget_bytes: int, slab_bytes: int, memory: Memory,
                 min_slot_bytes: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self.slab_bytes = slab_bytes
        self.memory = memory
        self.min_slot_bytes = min_slot_bytes  # each slot takes at least this much budget
        self.pools: dict[int, SlotPool] = {}
        self.reserved_bytes = 0  # bytes of slabs allocated
        self.used_bytes = 0  # bytes of slots in use

    def pool(self, slot_bytes: int) -> SlotPool:
        pool = self.pools.get(slot_bytes)
        if pool is None:
            stride = self.charge(slot_bytes)
            pool = SlotPool(slot_bytes, max(1, self.slab_bytes // stride), stride)
            self.pools[slot_bytes] = pool
        return pool

    def charge(self, slot_bytes: int) -> int:
        """What one slot of this size takes of the budget."""
        return max(slot_bytes, self.min_slot_bytes)

    def fits(self, slot_bytes: int) -> bool:
        """Whether one slot of this size can ever fit the budget."""
        return self.charge(slot_bytes) <= self.budget_bytes

    def alloc(self, slot_bytes: int, count: int) -> list[int]:
        """Up to `count` slots; fewer when the budget is spent (the caller evicts and retries)."""
        pool = self.pool(slot_bytes)
        slots = pool.pop(count)
        while len(slots) < count and self._grow(pool, count - len(slots)):
            slots += pool.pop(count - len(slots))
        self.used_bytes += len(slots) * pool.stride
        return slots

    def free(self, slot_bytes: int, slots: list[int]) -> None:
        pool = self.pools[slot_bytes]
        pool.push(list(slots))
        self.used_bytes -= len(slots) * pool.stride

    def reclaim(self) -> int:
        """Give the slabs that hold no entry back to the budget."""
        freed = 0
        for pool in self.pools.values():
            for slab in pool.release_empty():
                self.memory.release(slab)
                freed += slab.numel()
        self.reserved_bytes -= freed
        return freed

    def close(self) -> None:
        """Release every slab; the arena is empty afterwards."""
        for pool in self.pools.values():
            for slab in pool.slabs:
                if slab is not None:
                    self.memory.release(slab)
        self.memory.close()
        self.pools.clear()
        self.reserved_bytes = self.used_bytes = 0

    def _grow(self, pool: SlotPool, wanted: int) -> bool:
        """Add a slab to `pool`, taking back empty slabs of other pools if that makes room."""
        room = (self.budget_bytes - self.reserved_bytes) // pool.stride
        if room < min(wanted, pool.slots_per_slab) and self.reclaim():
            room = (self.budget_bytes - self.reserved_bytes) // pool.stride
        slots = min(pool.slots_per_slab, room)
        if slots <= 0:
            return False
        pool.add_slab(self.memory.allocate(slots, pool.stride))
        self.reserved_bytes += slots * pool.stride
        return True
