"""CpuTransfer: rows into entry slots and back, exact, whether a batch is copied on the
calling thread (small) or on the copy threads (from INLINE_BYTES)."""

import numpy as np
import pytest
import torch

from tiercache.tiers.arena import SlabPart
from tiercache.transfer import INLINE_BYTES, CpuTransfer

ROW = 4096
BUFFERS = 4


@pytest.mark.parametrize("entries", [1, 7, 2 * INLINE_BYTES // (BUFFERS * ROW)])
def test_gather_then_scatter_is_exact_on_either_path(entries):
    gen = torch.Generator().manual_seed(entries)
    buffers = [torch.randint(0, 256, (2 * entries, ROW), dtype=torch.uint8, generator=gen)
               for _ in range(BUFFERS)]
    offsets = [i * ROW for i in range(BUFFERS)]
    slab = torch.zeros((entries + 3, BUFFERS * ROW), dtype=torch.uint8)
    # slots out of order and not from 0: the copies must follow the positions
    local = np.random.default_rng(entries).permutation(entries + 3)[:entries]
    parts = [SlabPart(slab, local, np.arange(entries))]
    src = np.random.default_rng(1).permutation(2 * entries)[:entries]
    transfer = CpuTransfer(threads=2)
    try:
        transfer.gather(buffers, offsets, src, parts)
        assert (transfer._pool is not None) == (entries * BUFFERS * ROW >= INLINE_BYTES)
        for b, at in zip(buffers, offsets):
            assert torch.equal(slab[torch.from_numpy(local), at:at + ROW], b[torch.from_numpy(src)])
        dst = np.setdiff1d(np.arange(2 * entries), src)  # the other rows
        transfer.scatter(parts, buffers, offsets, dst)
        for b in buffers:
            assert torch.equal(b[torch.from_numpy(dst)], b[torch.from_numpy(src)])
    finally:
        transfer.close()
