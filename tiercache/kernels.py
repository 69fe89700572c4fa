"""Batched row copies on the GPU: one Triton launch moves one row of every buffer for
every entry, between worker buffers and contiguous entry slots.

An entry slot holds the rows of all buffers of a group back to back (see transfer.py).
The kernel reads two small tables instead of one pointer per row: per buffer its base
address, row stride, row width and offset inside an entry; per entry a worker row id and
the address of its slot. Slot addresses may point at device memory or at page-locked
host memory (addressed from the GPU), so the same launch serves device-to-device stores
and host-to-device loads at PCIe speed (measured on an H100: 50-52 GB/s each way into
and out of page-locked memory, against 54 GB/s for one bulk copy; device to device on an
H200: 1.87 TB/s against 2.06 for one copy). Addresses and sizes
must be 16-byte aligned so every access is a full 16-byte vector; BufferTable checks.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from tiercache.copy_engines import buffer_table
from tiercache.streams import current

ALIGN = 16
CHUNK_WORDS = 16 * 1024  # int32 words (64 KiB) of a row one program moves; longer rows split
BLOCK_WORDS = 2048  # words one program moves per step, at most; the shortest row sets it
WORDS_PER_THREAD = 4  # one 16-byte vector each


# The tables' addresses and the buffer count are not specialised on (their alignment, or
# a count of 1): a launch's kind is then its direction and step alone, a few per group
# of buffers, all compiled and loaded when the group registers (`prepare`).
_TABLES = ["buffer_base", "buffer_stride", "buffer_width", "buffer_offset", "entry_row",
           "entry_slot", "n_buffers"]


@triton.jit(do_not_specialize=_TABLES, do_not_specialize_on_alignment=_TABLES)
def _copy_rows(buffer_base, buffer_stride, buffer_width, buffer_offset, entry_row, entry_slot,
               n_buffers, to_slots: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # Program (entry * n_buffers + buffer, chunk) moves up to CHUNK words (int32) of one row.
    pid = tl.program_id(0)
    entry, buffer = pid // n_buffers, pid % n_buffers
    start = tl.program_id(1) * CHUNK
    width = tl.load(buffer_width + buffer) // 4
    if start < width:
        rows = tl.load(buffer_base + buffer) + tl.load(entry_row + entry) * tl.load(buffer_stride + buffer)
        slot = tl.load(entry_slot + entry) + tl.load(buffer_offset + buffer)
        if to_slots:
            src, dst = rows, slot
        else:
            src, dst = slot, rows
        # 16-byte aligned addresses and whole, unmasked blocks: every access is a 16-byte
        # vector. The hint goes on the pointers: given on the integer addresses, the cast
        # dropped it and every access was 4 bytes wide (the PTX, 2026-11-28; vectors took
        # 1-2% off a copy device to device and between the GPU and host memory, RESULTS.md)
        src_ptr = tl.multiple_of(src.to(tl.pointer_type(tl.int32)), 16)
        dst_ptr = tl.multiple_of(dst.to(tl.pointer_type(tl.int32)), 16)
        end = tl.minimum(start + CHUNK, width)
        full = start + (end - start) // BLOCK * BLOCK
        for at in range(start, full, BLOCK):
            words = tl.max_contiguous(tl.multiple_of(at + tl.arange(0, BLOCK), BLOCK), BLOCK)
            tl.store(dst_ptr + words, tl.load(src_ptr + words))
        if full < end:  # what is left of the row: one masked block, all threads at once
            words = tl.max_contiguous(tl.multiple_of(full + tl.arange(0, BLOCK), 4), BLOCK)
            left = words < end
            tl.store(dst_ptr + words, tl.load(src_ptr + words, mask=left), mask=left)


@dataclass(frozen=True)
class BufferTable:
    """The per-buffer half of a copy: built once per registered group of buffers."""

    base: torch.Tensor  # int64 addresses
    stride: torch.Tensor  # int64 row strides in bytes
    width: torch.Tensor  # int64 row bytes
    offset: torch.Tensor  # int64 offset of the row inside an entry
    max_width: int
    min_width: int
    host: np.ndarray  # int64 (4, buffers): base, stride, width, offset (copy_engines.py)
    addresses: tuple[int, ...]  # of base, stride, width and offset on the device

    @classmethod
    def of(cls, buffers: Sequence[torch.Tensor], offsets: Sequence[int],
           device: torch.device) -> "BufferTable":
        """Tables for uint8 [rows, row bytes] buffers, each row at `offsets` in an entry."""
        for b, at in zip(buffers, offsets):
            if any(v % ALIGN for v in (b.data_ptr(), b.stride(0), b.shape[1], at)):
                raise ValueError(f"a buffer's address, row stride, row bytes or entry offset is not "
                                 f"{ALIGN}-byte aligned: the GPU copy needs aligned rows")
        host = buffer_table(buffers, offsets)
        on_device = torch.from_numpy(host).to(device)
        return cls(*on_device, int(host[2].max()), int(host[2].min()), host,
                   tuple(t.data_ptr() for t in on_device))


# The kernels loaded so far, by (device, direction, step): a launch of a kind loaded
# before goes straight to its compiled kernel. Triton's own dispatch (binding and
# specialising the arguments, hashing the key) took 54-78 us a launch hot and 208-218 us
# after 10 ms idle on an H100 host, against 14-23 and 89-107 us straight.
_compiled: dict[tuple[int, bool, int], Any] = {}


def copy_rows(table: BufferTable, rows: torch.Tensor, slot_addresses: torch.Tensor,
              to_slots: bool, stream: torch.cuda.Stream | None = None) -> None:
    """Copy row rows[i] of every buffer to (or from) the entry at slot_addresses[i].

    `rows` and `slot_addresses` are contiguous int64 tensors on the buffers' device; slot
    addresses must be 16-byte aligned (arena slots are). The launch is asynchronous on
    `stream` (the current stream if None)."""
    entries, buffers = len(rows), len(table.width)
    if not entries or not buffers:
        return
    block = block_words(table.min_width)
    key = (rows.device.index, to_slots, block)
    if key in _compiled:
        handle = (stream if stream is not None else torch.cuda.current_stream(rows.device)).cuda_stream
        launch(table, rows.data_ptr(), slot_addresses.data_ptr(), entries, to_slots, key[0], handle)
        return
    pointers = (table.base, table.stride, table.width, table.offset, rows, slot_addresses)
    with current(stream) if stream is not None else nullcontext():
        _compiled[key] = _through_triton(_grid(table, entries), pointers, buffers, to_slots, block)


def launch(table: BufferTable, rows: int, slot_addresses: int, entries: int, to_slots: bool,
           device: int, stream: int) -> None:
    """`copy_rows`, its rows and slot addresses given by where they lie on GPU `device` (two
    int64 arrays of `entries` each) and its stream by its handle: for callers that keep
    them in memory of their own (transfer._Ring). The kernel is loaded first if it is not
    yet (`prepare`)."""
    if not entries or not len(table.width):
        return
    block = block_words(table.min_width)
    compiled = _compiled.get((device, to_slots, block))
    if compiled is None:
        prepare(torch.device("cuda", device), [table.min_width])
        compiled = _compiled[(device, to_slots, block)]
    # the tables by address and the stream given: Triton's launcher asked the driver about
    # each of six tensors' pointers and torch for the current stream, per launch
    compiled[_grid(table, entries)](*table.addresses, rows, slot_addresses, len(table.width), to_slots,
                                    CHUNK_WORDS, block, stream=stream)


def _grid(table: BufferTable, entries: int) -> tuple[int, int, int]:
    return (entries * len(table.width), triton.cdiv(table.max_width // 4, CHUNK_WORDS), 1)


def prepare(device: torch.device, row_bytes: Iterable[int]) -> None:
    """Compile and load, if not yet, the kernels that copy rows as short as each of
    `row_bytes`, both ways. Loading a kernel into the GPU's context waits for every copy
    queued on it, and so for whatever worker work those wait for: done when a worker
    registers, not in its first store or load."""
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        nothing = torch.empty(0, dtype=torch.int64, device=device)
        for block in {block_words(width) for width in row_bytes}:
            for to_slots in (True, False):
                key = (nothing.device.index, to_slots, block)
                if key not in _compiled:  # a grid of none: loaded, nothing launched
                    _compiled[key] = _through_triton((0, 1, 1), (nothing,) * 6, 1, to_slots, block)


def _through_triton(grid: tuple[int, int, int], pointers: Sequence[torch.Tensor], buffers: int,
                    to_slots: bool, block: int) -> Any:
    """Launch through Triton's dispatch (compiling, or finding the kernel on disk, and
    loading it at its first launch); returns the compiled kernel."""
    return _copy_rows[grid](*pointers, buffers, to_slots=to_slots, CHUNK=CHUNK_WORDS, BLOCK=block,
                            num_warps=max(1, min(8, block // (32 * WORDS_PER_THREAD))))


def block_words(min_width: int) -> int:
    """The step of the copy: the largest power of two of words that the shortest row
    fills (a 4 KiB row is one step of all the program's threads, not 256 steps of one
    16-byte vector), at most BLOCK_WORDS."""
    words = max(4, min_width // 4)
    return min(BLOCK_WORDS, 1 << (words.bit_length() - 1))
