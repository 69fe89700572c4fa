"""The Triton row copy: on the GPU when there is one, else under Triton's interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton compiles anything
pytest.importorskip("triton")

from tiercache.kernels import ALIGN, BufferTable, copy_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_rows(rows, width, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=gen).to(DEVICE)


def test_rows_of_many_buffers_go_to_slots_and_back_exactly():
    # three buffers: a small row, a 16 KiB row, and a row longer than one program's chunk
    widths = [48, 16384, 64 * 1024 + 80]
    source = [random_rows(12, w, seed) for seed, w in enumerate(widths)]
    offsets = [0, 48, 48 + 16384]
    entry = sum(widths)
    slab = torch.full((6, entry), 0xA5, dtype=torch.uint8, device=DEVICE)  # poisoned
    # entries 0..3 come from rows 7, 2, 11, 0 and go to slots 5, 1, 3, 0
    rows = torch.tensor([7, 2, 11, 0], device=DEVICE)
    slots = torch.tensor([slab[s].data_ptr() for s in (5, 1, 3, 0)], device=DEVICE)
    copy_rows(BufferTable.of(source, offsets, DEVICE), rows, slots, to_slots=True)
    for n, s in enumerate((5, 1, 3, 0)):
        for b, (w, at) in enumerate(zip(widths, offsets)):
            assert torch.equal(slab[s, at:at + w], source[b][rows[n]])
    assert torch.all(slab[2] == 0xA5) and torch.all(slab[4] == 0xA5)  # untouched slots stay
    # back into other rows of fresh buffers
    dest = [torch.zeros_like(b) for b in source]
    back = torch.tensor([1, 9, 4, 6], device=DEVICE)
    copy_rows(BufferTable.of(dest, offsets, DEVICE), back, slots, to_slots=False)
    for n in range(4):
        for b in range(3):
            assert torch.equal(dest[b][back[n]], source[b][rows[n]])
    assert int(dest[0][0].sum()) == 0  # rows nobody loaded stay as they were


@pytest.mark.parametrize("width", [4096, 6144, 16 + 4096])
def test_short_and_uneven_rows_copy_whole(width):
    # a 4 KiB row is one step; 6 KiB and 4 KiB + 16 bytes leave a masked tail
    source = [random_rows(8, width, 1), random_rows(8, 2 * width, 2)]
    slab = torch.full((4, 3 * width), 0xA5, dtype=torch.uint8, device=DEVICE)
    slots = torch.tensor([slab[s].data_ptr() for s in (3, 0)], device=DEVICE)
    rows = torch.tensor([6, 1], device=DEVICE)
    copy_rows(BufferTable.of(source, [0, width], DEVICE), rows, slots, to_slots=True)
    for n, s in enumerate((3, 0)):
        assert torch.equal(slab[s, :width], source[0][rows[n]])
        assert torch.equal(slab[s, width:], source[1][rows[n]])
    assert torch.all(slab[1] == 0xA5) and torch.all(slab[2] == 0xA5)


def test_the_step_is_the_largest_power_of_two_the_shortest_row_fills():
    from tiercache.kernels import block_words
    assert [block_words(w) for w in (16, 48, 4096, 6144, 1 << 20)] == [4, 8, 1024, 1024, 2048]


def test_unaligned_rows_are_refused():
    odd = random_rows(4, 40, 0)  # 40-byte rows: not a multiple of 16
    with pytest.raises(ValueError, match=f"{ALIGN}-byte"):
        BufferTable.of([odd], [0], DEVICE)


def test_launches_of_a_kind_seen_before_and_of_any_alignment_copy_exactly():
    # the second launch of a kind goes straight to its compiled kernel (kernels._compiled);
    # rows and slot addresses 8 bytes off a multiple of 16 are the same kind (the tables'
    # alignment is not specialised on): the kernel compiled for aligned ones copies them
    from tiercache import kernels
    source = random_rows(16, 4096, 3)
    slab = torch.zeros((16, 4096), dtype=torch.uint8, device=DEVICE)
    table = BufferTable.of([source], [0], DEVICE)
    every_row = torch.arange(16, device=DEVICE)
    every_slot = torch.tensor([slab[s].data_ptr() for s in range(16)], device=DEVICE)
    for start in (0, 0, 1, 1):
        slab.zero_()
        copy_rows(table, every_row[start:start + 15], every_slot[start:start + 15], to_slots=True)
        assert torch.equal(slab[start:start + 15], source[start:start + 15])
        assert int(slab[15 if start == 0 else 0].sum()) == 0
    if DEVICE.type == "cuda":  # one kernel for both alignments (the interpreter keeps none)
        assert [k for k in kernels._compiled if k[1:] == (True, 1024)] == [(DEVICE.index or 0, True, 1024)]


def test_prepared_kernels_are_loaded_both_ways_and_copy_exactly():
    # what a worker's registration does (Engine.prepare): a launch of no entries loads
    # the kernel of each direction, and later copies of that kind go straight to it
    from tiercache import kernels
    kernels.prepare(DEVICE, [8192 + 16])  # a step of 2,048 words
    if DEVICE.type == "cuda":
        index = torch.empty(0, device=DEVICE).device.index
        assert {(index, True, 2048), (index, False, 2048)} <= set(kernels._compiled)
    source = random_rows(4, 8192 + 16, 4)
    slab = torch.zeros((4, 8192 + 16), dtype=torch.uint8, device=DEVICE)
    slots = torch.tensor([slab[s].data_ptr() for s in (2, 0, 3, 1)], device=DEVICE)
    copy_rows(BufferTable.of([source], [0], DEVICE), torch.arange(4, device=DEVICE), slots, to_slots=True)
    back = torch.zeros_like(source)
    copy_rows(BufferTable.of([back], [0], DEVICE), torch.arange(4, device=DEVICE), slots, to_slots=False)
    assert torch.equal(back, source) and torch.equal(slab[2], source[0])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter compiles no PTX")
def test_whole_blocks_move_16_byte_vectors():
    # the addresses' alignment hint must reach the pointers the copy reads and writes:
    # given on the integer addresses before their cast, it was dropped, and every access
    # was 4 bytes wide
    from tiercache import kernels
    kernels.prepare(DEVICE, [4096])
    index = torch.empty(0, device=DEVICE).device.index
    for to_slots in (True, False):
        ptx = kernels._compiled[(index, to_slots, 1024)].asm["ptx"]
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx
