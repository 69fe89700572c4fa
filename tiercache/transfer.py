"""Moving rows between worker buffers and arena slots.

An entry is the concatenation of one row of every buffer in a group (the paged buffers
for a KV page, the slot buffers for a checkpoint), at the offsets the layout gives.
`gather` copies worker rows into entries, `scatter` copies entries into worker rows;
both take one call per batch, not one per row. This is the CPU path: one vectorised copy
per buffer, reading or writing the arena side as a slice whenever the slots form a
consecutive run (the usual case), so every byte is copied once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import torch

from tiercache.tiers.arena import SlabPart


def _by_slot(part: SlabPart, rows: np.ndarray) -> tuple[slice | np.ndarray, np.ndarray]:
    """The part's slots, as a slice when they form a consecutive run, and the worker rows
    in the same order."""
    order = np.argsort(part.local, kind="stable")
    local, rows = part.local[order], rows[part.positions][order]
    if local.size and local[-1] - local[0] == local.size - 1:  # distinct, so a run
        return slice(int(local[0]), int(local[-1]) + 1), rows
    return local, rows


class CpuTransfer:
    def __init__(self, threads: int = 2) -> None:
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def _each(self, jobs: list[Callable[[], None]]) -> None:
        if len(jobs) < 2 or self._threads < 2:
            for job in jobs:
                job()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="tiercache-copy")
        for future in [self._pool.submit(job) for job in jobs]:
            future.result()

    def gather(self, buffers: Sequence[torch.Tensor], offsets: Sequence[int],
               rows: np.ndarray, part: SlabPart) -> None:
        """part.slab[part.local[i], entry bytes of buffer b] = buffers[b][rows[part.positions[i]]]."""
        slots, rows = _by_slot(part, rows)
        index = torch.from_numpy(rows)

        def copy(buffer: torch.Tensor, at: int) -> Callable[[], None]:
            width = buffer.shape[1]
            if isinstance(slots, slice):  # straight into the strided slice, one pass
                return lambda: torch.index_select(buffer, 0, index, out=part.slab[slots, at:at + width])
            return lambda: part.slab.numpy().__setitem__((slots, slice(at, at + width)),
                                                         buffer.numpy()[rows])
        self._each([copy(b, at) for b, at in zip(buffers, offsets)])

    def scatter(self, part: SlabPart, buffers: Sequence[torch.Tensor], offsets: Sequence[int],
                rows: np.ndarray) -> None:
        """buffers[b][rows[part.positions[i]]] = part.slab[part.local[i], entry bytes of buffer b]."""
        slots, rows = _by_slot(part, rows)
        slab = part.slab.numpy()

        def copy(buffer: torch.Tensor, at: int) -> Callable[[], None]:
            # numpy scatters without the GIL: a few threads share the buffers
            return lambda: buffer.numpy().__setitem__(rows, slab[slots, at:at + buffer.shape[1]])
        self._each([copy(b, at) for b, at in zip(buffers, offsets)])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
