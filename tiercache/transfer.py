"""Moving rows between worker buffers and arena slots.

An entry is the concatenation of one row of every buffer in a group (the paged buffers
for a KV page, the slot buffers for a checkpoint), at the offsets the layout gives.
`gather` copies worker rows into entries, `scatter` copies entries into worker rows;
both take one call per batch, not one per row. This is the CPU path: one vectorised copy
per buffer, spread over a few threads, reading or writing the arena side as a slice
whenever the slots are consecutive (the usual case), so every byte is copied once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import torch

from tiercache.tiers.arena import SlabPart


def _run(local: np.ndarray) -> slice | None:
    """`local` as a slice when it counts up by one, else None."""
    if local.size and local[-1] - local[0] == local.size - 1 and (
            local.size < 3 or np.all(np.diff(local) == 1)):
        return slice(int(local[0]), int(local[-1]) + 1)
    return None


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
        """part.slab[part.local[i], entry bytes of buffer b] = buffers[b][rows[i]]."""
        run = _run(part.local)
        rows_t = torch.from_numpy(rows[part.positions])
        local_rows = rows[part.positions]
        slab_np = part.slab.numpy()

        def copy(buffer: torch.Tensor, at: int) -> Callable[[], None]:
            width = buffer.shape[1]
            if run is not None:  # torch gathers straight into the strided slice: one pass
                return lambda: torch.index_select(buffer, 0, rows_t, out=part.slab[run, at:at + width])
            return lambda: slab_np.__setitem__((part.local, slice(at, at + width)),
                                               buffer.numpy()[local_rows])
        self._each([copy(b, at) for b, at in zip(buffers, offsets)])

    def scatter(self, part: SlabPart, buffers: Sequence[torch.Tensor], offsets: Sequence[int],
                rows: np.ndarray) -> None:
        """buffers[b][rows[i]] = part.slab[part.local[i], entry bytes of buffer b]."""
        run = _run(part.local)
        slab_np = part.slab.numpy()
        local_rows = rows[part.positions]
        source = part.local if run is None else run

        def copy(buffer: torch.Tensor, at: int) -> Callable[[], None]:
            width = buffer.shape[1]
            return lambda: buffer.numpy().__setitem__(local_rows, slab_np[source, at:at + width])
        self._each([copy(b, at) for b, at in zip(buffers, offsets)])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
