"""CpuTransfer: rows into entry slots and back, exact, whether a batch is copied on the
calling thread (small) or on the copy threads (from INLINE_BYTES)."""

import numpy as np
import pytest
import torch

from tiercache.tiers.arena import SlabPart
from tiercache.transfer import INLINE_BYTES, CpuTransfer

ROW = 4096
BUFFERS = 4


@pytest.mark.parametrize("entries", [1, 7, INLINE_BYTES // (BUFFERS * ROW) - 1,
                                     INLINE_BYTES // (BUFFERS * ROW), 2 * INLINE_BYTES // (BUFFERS * ROW)])
def test_gather_then_scatter_is_exact_on_either_path(entries):
    gen = torch.Generator().manual_seed(entries)
    buffers = [torch.randint(1, 256, (3 * entries, ROW), dtype=torch.uint8, generator=gen)
               for _ in range(BUFFERS)]
    offsets = [i * ROW for i in range(BUFFERS)]
    rng = np.random.default_rng(entries)
    # two slabs, slots out of order and not from 0, the entries' positions shuffled
    # between them: each copy must follow its part's positions
    slabs = [torch.zeros((entries + 3, BUFFERS * ROW), dtype=torch.uint8) for _ in range(2)]
    positions = rng.permutation(entries)
    cut = entries // 2
    parts = [SlabPart(slab, rng.permutation(entries + 3)[:len(at)], at)
             for slab, at in zip(slabs, (positions[:cut], positions[cut:]))]
    src, dst = np.split(rng.permutation(3 * entries)[:2 * entries], 2)
    transfer = CpuTransfer(threads=2)
    try:
        transfer.gather(buffers, offsets, src, parts)
        assert (transfer._pool is not None) == (entries * BUFFERS * ROW >= INLINE_BYTES)
        for part in parts:
            local, rows = torch.from_numpy(part.local), torch.from_numpy(src[part.positions])
            for b, at in zip(buffers, offsets):
                assert torch.equal(part.slab[local, at:at + ROW], b[rows])
            untouched = np.setdiff1d(np.arange(entries + 3), part.local)
            assert not part.slab[torch.from_numpy(untouched)].any()  # nothing else written
        before = [b.clone() for b in buffers]
        transfer.scatter(parts, buffers, offsets, dst)
        others = torch.from_numpy(np.setdiff1d(np.arange(3 * entries), dst))
        for b, old in zip(buffers, before):
            assert torch.equal(b[torch.from_numpy(dst)], b[torch.from_numpy(src)])
            assert torch.equal(b[others], old[others])  # rows not loaded into stay as they were
    finally:
        transfer.close()


@pytest.mark.parametrize("widths", [(100, 3000, 7), (256, 4096 + 48, 1 << 16), (16, 32, 300)])
def test_rows_of_any_width_and_offset_come_back_exact(widths):
    """Rows whose widths and offsets are not multiples of 16 (copied by plain memcpy) beside
    aligned ones of 256 bytes and more (non-temporal writes), into slots of a stride
    larger than the entry, both directions, on one thread and on two."""
    gen, rng = torch.Generator().manual_seed(sum(widths)), np.random.default_rng(len(widths))
    entry = sum(widths) + 5  # the slot's tail is no entry's
    offsets = np.concatenate([[0], np.cumsum(widths)[:-1]]).tolist()
    for entries in (3, INLINE_BYTES // sum(widths) + 1):
        buffers = [torch.randint(1, 256, (2 * entries + 1, w), dtype=torch.uint8, generator=gen)
                   for w in widths]
        slab = torch.zeros((entries + 2, entry + 11), dtype=torch.uint8)
        part = SlabPart(slab, rng.permutation(entries + 2)[:entries], np.arange(entries))
        src, dst = np.split(rng.permutation(2 * entries + 1)[:2 * entries], 2)
        transfer = CpuTransfer(threads=2)
        try:
            transfer.gather(buffers, offsets, src, [part])
            local = torch.from_numpy(part.local)
            for b, at in zip(buffers, offsets):
                assert torch.equal(slab[local, at:at + b.shape[1]], b[torch.from_numpy(src)])
            assert not slab[:, entry:].any()  # nothing past the entry
            transfer.scatter([part], buffers, offsets, dst)
            for b in buffers:
                assert torch.equal(b[torch.from_numpy(dst)], b[torch.from_numpy(src)])
        finally:
            transfer.close()


def test_rows_or_slots_outside_their_buffers_are_refused_before_any_copy():
    buffers = [torch.ones((4, 64), dtype=torch.uint8)]
    slab = torch.zeros((2, 64), dtype=torch.uint8)
    transfer = CpuTransfer(threads=1)
    for rows, local, offsets in (([4], [0], [0]), ([-1], [0], [0]), ([0], [2], [0]), ([0], [0], [8])):
        part = SlabPart(slab, np.array(local), np.array([0]))
        with pytest.raises(ValueError):
            transfer.gather(buffers, offsets, np.array(rows), [part])
        with pytest.raises(ValueError):
            transfer.scatter([part], buffers, offsets, np.array(rows))
    assert not slab.any() and bool((buffers[0] == 1).all())
