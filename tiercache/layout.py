"""The description of a worker's buffers.

A *paged* buffer has one row per KV page (e.g. one layer's K, or V). A *slot* buffer has
one row per request state slot (e.g. one layer's conv or recurrent state). A KV page
entry is the concatenation of that page's row in every paged buffer; a checkpoint is the
concatenation of one slot's row in every slot buffer. The fingerprint names what makes
bytes reusable (row shapes, dtypes, page size, tensor-parallel rank), not row counts:
two workers of the same model with different pool sizes share entries.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

import xxhash

from tiercache.errors import InvalidArgument
from tiercache.flops import ModelShape

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


MAX_NAME = 200  # characters of a buffer name


class LayoutError(InvalidArgument):
    """A layout field is wrong; the message names it."""


def dtype_name(dtype: Any) -> str:
    """'torch.bfloat16', numpy dtypes and plain names all map to 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class BufferSpec:
    name: str
    rows: int
    row_shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not self.name:
            raise LayoutError("buffer.name is empty: give every buffer a unique name")
        if len(self.name) > MAX_NAME or not self.name.isprintable():
            raise LayoutError(f"buffer name {self.name[:40]!r}... is not a printable name of at "
                              f"most {MAX_NAME} characters")
        where = f"buffer {self.name!r}"
        if not isinstance(self.rows, int) or self.rows <= 0:
            raise LayoutError(f"{where}: rows must be a positive integer, got {self.rows!r}")
        object.__setattr__(self, "row_shape", tuple(self.row_shape))
        if any(not isinstance(d, int) or d <= 0 for d in self.row_shape):
            raise LayoutError(f"{where}: row_shape must hold positive integers, got {self.row_shape!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(f"{where}: dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * DTYPE_BYTES[self.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.row_shape)

    @classmethod
    def of(cls, name: str, tensor: Any) -> "BufferSpec":
        """The spec of a tensor-like object (torch or numpy): first dimension = rows."""
        shape = tuple(int(d) for d in tensor.shape)
        if not shape:
            raise LayoutError(f"buffer {name!r}: a buffer needs a row dimension, got a scalar")
        return cls(name, shape[0], shape[1:], dtype_name(tensor.dtype))


@dataclass(frozen=True)
class Layout:
    page_tokens: int
    paged: tuple[BufferSpec, ...] = ()
    slots: tuple[BufferSpec, ...] = ()
    tp_rank: int = 0
    tp_size: int = 1
    # What the model's prefill costs, for eviction by FLOPs saved. Not part of the
    # fingerprint: it says what the bytes are worth, not whether they can be reused.
    model: ModelShape | None = field(default=None, compare=False)
    fingerprint: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "paged", tuple(self.paged))
        object.__setattr__(self, "slots", tuple(self.slots))
        if not isinstance(self.page_tokens, int) or self.page_tokens <= 0:
            raise LayoutError(f"page_tokens must be a positive integer, got {self.page_tokens!r}")
        if not self.paged and not self.slots:
            raise LayoutError("layout has no buffers: give at least one paged or slot buffer")
        names = [b.name for b in (*self.paged, *self.slots)]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise LayoutError(f"buffer name {duplicate!r} appears twice: names must be unique")
        for kind, specs in (("paged", self.paged), ("slots", self.slots)):
            if len({b.rows for b in specs}) > 1:
                raise LayoutError(f"{kind} buffers have different row counts "
                                  f"{[b.rows for b in specs]}: a row id must index every one")
        if self.model is not None and not isinstance(self.model, ModelShape):
            raise LayoutError(f"model must be a ModelShape or None, got {type(self.model).__name__}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank must lie in [0, tp_size={self.tp_size}), got {self.tp_rank}")
        canonical = json.dumps(self._identity(), sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "fingerprint", xxhash.xxh3_128_hexdigest(canonical.encode()))

    def _identity(self) -> dict[str, Any]:
        def spec(b: BufferSpec) -> list[Any]:
            return [b.name, list(b.row_shape), b.dtype]
        return {"v": 1, "page_tokens": self.page_tokens, "tp": [self.tp_rank, self.tp_size],
                "paged": [spec(b) for b in self.paged], "slots": [spec(b) for b in self.slots]}

    @property
    def needs_pages(self) -> bool:
        return bool(self.paged)

    @property
    def needs_checkpoint(self) -> bool:
        return bool(self.slots)

    @cached_property  # asked several times a call: a sum over up to a thousand buffers
    def page_bytes(self) -> int:
        """Bytes of one KV page entry."""
        return sum(b.row_bytes for b in self.paged)

    @cached_property
    def checkpoint_bytes(self) -> int:
        return sum(b.row_bytes for b in self.slots)

    @property
    def page_rows(self) -> int:
        """KV page rows of the worker (0 without paged buffers)."""
        return self.paged[0].rows if self.paged else 0

    @property
    def slot_rows(self) -> int:
        """State slots of the worker (0 without slot buffers)."""
        return self.slots[0].rows if self.slots else 0

    @classmethod
    def of(cls, page_tokens: int, paged: Mapping[str, Any] | None = None,
           slots: Mapping[str, Any] | None = None, tp_rank: int = 0, tp_size: int = 1,
           model: ModelShape | None = None) -> "Layout":
        """The layout of named tensors, e.g. Layout.of(16, paged={"k0": k0, "v0": v0})."""
        return cls(page_tokens,
                   tuple(BufferSpec.of(n, t) for n, t in (paged or {}).items()),
                   tuple(BufferSpec.of(n, t) for n, t in (slots or {}).items()),
                   tp_rank, tp_size, model)
