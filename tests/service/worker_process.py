"""A worker in its own process, driven by the daemon tests.

    python -m tests.service.worker_process store ADDRESS SEED PROMPTS [--hold]
    python -m tests.service.worker_process load ADDRESS SEED PROMPTS

`store` fills its shared-memory buffers with bytes drawn from SEED, stores PROMPTS
prompts (each from its own rows, with a checkpoint at its end) and prints "stored N"
after each; with --hold it then waits to be killed. `load` loads the same prompts into
other rows and slots and prints "ok N", or "bad N" if any byte differs from what `store`
had in its rows.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from tiercache.client import Client
from tiercache.layout import BufferSpec, Layout

PAGES = 6  # per prompt
LAYOUT = Layout(16, paged=tuple(BufferSpec(f"kv{i}", 64, (16, 2, 8), "bfloat16") for i in range(3)),
                slots=(BufferSpec("conv", 16, (24, 3), "bfloat16"), BufferSpec("ssm", 16, (4, 8, 8), "float32")))


def prompt(n: int) -> list[int]:
    return np.random.default_rng(1000 + n).integers(0, 150_000, PAGES * 16 + 5).tolist()


def source_bytes(seed: int) -> dict[str, torch.Tensor]:
    """What the storing worker's buffers hold, as raw bytes per buffer."""
    gen = torch.Generator().manual_seed(seed)
    return {b.name: torch.randint(0, 256, (b.rows, b.row_bytes), dtype=torch.uint8, generator=gen)
            for b in (*LAYOUT.paged, *LAYOUT.slots)}


def rows_of(worker, name: str) -> torch.Tensor:
    tensor = {**worker.paged, **worker.slots}[name]
    return tensor.reshape(tensor.shape[0], -1).view(torch.uint8)


def store(address: str, seed: int, prompts: int, hold: bool) -> None:
    worker = Client(address).register("test-model", LAYOUT)
    for name, data in source_bytes(seed).items():
        rows_of(worker, name).copy_(data)
    for n in range(prompts):
        result = worker.store(prompt(n), kv_rows=range(n * PAGES, (n + 1) * PAGES),
                              checkpoints={PAGES * 16: n})
        assert result.checkpoints == (PAGES,), result
        print(f"stored {n}", flush=True)
    while hold:
        time.sleep(1)
    worker.close()


def load(address: str, seed: int, prompts: int) -> None:
    expected = source_bytes(seed)
    worker = Client(address).register("test-model", LAYOUT)
    for name in expected:  # poison the destination: unwritten rows must show
        rows_of(worker, name).fill_(0xA5)
    for n in range(prompts):
        rows = list(range(63 - n * PAGES, 63 - (n + 1) * PAGES, -1))  # other rows, backwards
        slot = 15 - n
        result = worker.load(prompt(n), kv_rows=rows, slot=slot)
        good = result.match.pages == PAGES and all(
            torch.equal(rows_of(worker, b.name)[rows], expected[b.name][n * PAGES:(n + 1) * PAGES])
            for b in LAYOUT.paged) and all(
            torch.equal(rows_of(worker, b.name)[slot], expected[b.name][n]) for b in LAYOUT.slots)
        print(f"{'ok' if good else 'bad'} {n}", flush=True)
    worker.close()


if __name__ == "__main__":
    mode, address, seed, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "store":
        store(address, seed, count, hold="--hold" in sys.argv)
    else:
        load(address, seed, count)
