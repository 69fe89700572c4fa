"""A worker's tensors bound to its layout, seen as rows of bytes.

Wherever the tensors come from (the caller's own memory, POSIX shared memory mapped by
the daemon, CUDA IPC handles opened by the daemon), the engine sees the same thing: for
each buffer a uint8 tensor [rows, row_bytes], and row ids to copy from or into.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from tiercache import _rows
from tiercache.errors import InvalidArgument
from tiercache.layout import BufferSpec, Layout, LayoutError, dtype_name


def byte_rows(tensor: torch.Tensor, spec: BufferSpec) -> torch.Tensor:
    """`tensor` as uint8 [rows, row_bytes], without a copy; each row must be contiguous."""
    where = f"buffer {spec.name!r}"
    if tuple(tensor.shape) != spec.shape:
        raise LayoutError(f"{where}: tensor shape {tuple(tensor.shape)} != layout shape {spec.shape}")
    if dtype_name(tensor.dtype) != spec.dtype:
        raise LayoutError(f"{where}: tensor dtype {dtype_name(tensor.dtype)} != layout dtype {spec.dtype}")
    rows = tensor.reshape(spec.rows, -1)
    if rows.stride(1) != 1 or rows.data_ptr() != tensor.data_ptr() or (
            rows.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()):
        raise LayoutError(f"{where}: each row must be contiguous in memory (pass a tensor whose "
                          "dimensions after the first are contiguous)")
    return rows.view(torch.uint8)


@dataclass(frozen=True)
class WorkerBuffers:
    layout: Layout
    paged: tuple[torch.Tensor, ...]  # uint8 [page rows, row bytes], in layout order
    slots: tuple[torch.Tensor, ...]  # uint8 [state slots, row bytes], in layout order
    device: torch.device

    @classmethod
    def bind(cls, layout: Layout, paged: Sequence[Any] | Mapping[str, Any] = (),
             slots: Sequence[Any] | Mapping[str, Any] = ()) -> "WorkerBuffers":
        """Check tensors against `layout` (by name, or in layout order) and view them as rows."""
        bound = [_bind_group(kind, specs, tensors) for kind, specs, tensors in
                 (("paged", layout.paged, paged), ("slots", layout.slots, slots))]
        devices = {t.device for group in bound for t in group}
        if len(devices) != 1:
            raise LayoutError(f"buffers lie on several devices {sorted(map(str, devices))}: "
                              "bind the buffers of one device at a time")
        return cls(layout, bound[0], bound[1], devices.pop())

    @cached_property  # every copy asks: a loop over 72 buffers took ~30 us a call
    def page_offsets(self) -> list[int]:
        return _offsets(self.paged)

    @cached_property
    def slot_offsets(self) -> list[int]:
        return _offsets(self.slots)


def _bind_group(kind: str, specs: tuple[BufferSpec, ...],
                tensors: Sequence[Any] | Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    if isinstance(tensors, Mapping):
        unknown = set(tensors) - {s.name for s in specs}
        if unknown:
            raise LayoutError(f"{kind}: buffers {sorted(unknown)} are not in the layout")
        missing = [s.name for s in specs if s.name not in tensors]
        if missing:
            raise LayoutError(f"{kind}: buffers {missing} of the layout are missing")
        ordered = [tensors[s.name] for s in specs]
    else:
        ordered = list(tensors)
        if len(ordered) != len(specs):
            raise LayoutError(f"{kind}: got {len(ordered)} tensors, the layout has {len(specs)}")
    return tuple(byte_rows(t, s) for t, s in zip(ordered, specs))


def _offsets(rows: tuple[torch.Tensor, ...]) -> list[int]:
    offsets, at = [], 0
    for buffer in rows:
        offsets.append(at)
        at += buffer.shape[1]
    return offsets


def int_ids(rows: Any, what: str) -> np.ndarray:
    """Ids given as a list, an array or a tensor, as a flat int64 array; a clear error
    for anything else."""
    if type(rows) in (list, tuple) and rows and type(rows[0]) is not bool:
        try:  # unsigned 32-bit: 3x faster than np.asarray (5,461 ints 30 against 87-113 us)
            return np.frombuffer(array.array("I", rows), np.uint32).astype(np.int64)
        except (TypeError, OverflowError):
            pass  # not all ints in [0, 2**32): the general path says what is wrong
    ids = np.asarray(rows.cpu() if isinstance(rows, torch.Tensor) else rows)
    if ids.size == 0:
        return np.empty(0, np.int64)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must be a flat list of integers")
    return ids.astype(np.int64, copy=False)


def row_ids(rows: Any, limit: int, what: str, unique: bool = False) -> np.ndarray:
    """Row ids as int64, each in [0, limit); a clear error otherwise."""
    ids = np.ascontiguousarray(int_ids(rows, what))
    wrong = _rows.check_rows(ids, limit, unique)  # one pass in C: a bitmap of the rows seen
    if wrong is not None and wrong[1] == 0:
        raise InvalidArgument(f"{what} {int(ids[wrong[0]])} is out of range: the buffer has "
                              f"{limit} rows")
    if wrong is not None:
        raise InvalidArgument(f"{what} repeat a row: every destination row must be distinct")
    return ids


def device_buffers(layout: Layout, device: torch.device) -> dict[str, torch.Tensor]:
    """Every buffer of `layout` carved out of one allocation on `device`: a CUDA IPC handle
    exposes the whole allocation it names, so the daemon sees these rows and nothing else."""
    align = 512  # keeps every view aligned for any dtype and for vectorised copies
    specs = (*layout.paged, *layout.slots)
    offsets, total = [], 0
    for spec in specs:
        offsets.append(total)
        total += -(-spec.rows * spec.row_bytes // align) * align
    block = torch.zeros(total, dtype=torch.uint8, device=device)
    return {spec.name: block[at:at + spec.rows * spec.row_bytes].view(getattr(torch, spec.dtype))
            .view(spec.shape) for spec, at in zip(specs, offsets)}
