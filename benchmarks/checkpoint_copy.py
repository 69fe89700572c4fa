"""A hybrid model's checkpoint between host memory and a worker's state slots on the GPU.

One Qwen3-Next-shaped entry: 36 GDN layers, each a 2 MiB recurrent state and a 48 KiB
conv state (74 MiB), too long to pass through CudaTransfer's ring. Copied either by the
Triton launch reading or writing host memory itself, or as CudaTransfer copies such an
entry: the 2 MiB rows on the copy engines, the 48 KiB rows by the launch. Beside them, in
the same run: a bulk pinned copy of the same bytes (the PCIe limit), and 12 bf16 matmuls
of 8192^3 on a worker's stream, alone and beside four such copies (what a copy takes from
the worker's kernels). CUDA events, medians of 9 after a warm-up.
"""

from __future__ import annotations

import statistics
from typing import Callable

import numpy as np
import torch

from benchmarks.common import print_summary, print_table
from tiercache.tiers.arena import SlabPart
from tiercache.tiers.host import HostMemory
from tiercache.transfer import MAX_STAGED_ENTRY, CudaTransfer

MiB = 1 << 20
LAYERS, RECURRENT, CONV = 36, 32 * 128 * 128 * 4, 8192 * 3 * 2
REPEAT = 9


def timed_ms(stream: torch.cuda.Stream, fn: Callable[[], None]) -> float:
    """Median ms of `fn`'s work on `stream` (CUDA events)."""
    times = []
    for n in range(REPEAT + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        if n:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    device = torch.device("cuda")
    widths = [w for _ in range(LAYERS) for w in (RECURRENT, CONV)]
    buffers = [torch.randint(0, 256, (2, w), dtype=torch.uint8, device=device) for w in widths]
    offsets = np.concatenate([[0], np.cumsum(widths)[:-1]]).tolist()
    entry = sum(widths)
    assert entry > MAX_STAGED_ENTRY  # not staged: the split path, or the launch alone
    memory, transfer = HostMemory(pin=True), CudaTransfer.open(device)
    slab = memory.allocate(1, entry)
    part, rows = SlabPart(slab, np.arange(1), np.arange(1)), np.array([1])
    addresses = np.array([slab.data_ptr()], np.int64)
    table, _ = transfer._table(buffers, offsets)

    def copy(direction: str, split: bool) -> Callable[[], None]:
        if not split:
            return lambda: transfer._run(table, rows, addresses, direction == "store", direction)
        if direction == "store":
            return lambda: transfer.gather(buffers, offsets, rows, [part])
        return lambda: transfer.scatter([part], buffers, offsets, rows)

    on_gpu = torch.empty(entry, dtype=torch.uint8, device=device)
    bulk = {"load": lambda: on_gpu.copy_(slab.view(-1)[:entry], non_blocking=True),
            "store": lambda: slab.view(-1)[:entry].copy_(on_gpu, non_blocking=True)}
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    worker = torch.cuda.Stream()

    def matmuls_ms(beside: Callable[[], None] | None) -> float:
        def run() -> None:
            with torch.cuda.stream(worker):
                for _ in range(12):
                    a @ b
            if beside is not None:
                for _ in range(4):
                    beside()
        return timed_ms(worker, run)

    copies, kernels, summary = [], [], {}
    for direction in ("load", "store"):
        stream = transfer._streams[direction]
        launch_ms, split_ms = (timed_ms(stream, copy(direction, split)) for split in (False, True))
        bulk_ms = timed_ms(torch.cuda.current_stream(), bulk[direction])
        copies.append((direction, bulk_ms, launch_ms, split_ms, launch_ms / bulk_ms, split_ms / bulk_ms))
        alone = matmuls_ms(None)
        beside = [matmuls_ms(copy(direction, split)) / alone for split in (False, True)]
        kernels.append((direction, alone, *beside))
        summary.update({f"{direction}_launch_over_bulk": launch_ms / bulk_ms,
                        f"{direction}_split_over_bulk": split_ms / bulk_ms,
                        f"matmuls_beside_{direction}_launch": beside[0],
                        f"matmuls_beside_{direction}_split": beside[1]})
    memory.release(slab)
    memory.close()
    transfer.close()
    print_table(f"one {entry / MiB:.0f} MiB checkpoint (36 x 2 MiB + 36 x 48 KiB rows) between host "
                f"memory and state slots (ms, CUDA events, median of {REPEAT})",
                ["copy", "bulk ms", "launch ms", "split ms", "launch / bulk", "split / bulk"], copies)
    print_table("12 bf16 matmuls of 8192^3 on the worker's stream, alone and beside 4 of these copies",
                ["copy", "alone ms", "beside the launch / alone", "beside the split / alone"], kernels)
    print_summary(**summary)


if __name__ == "__main__":
    main()
