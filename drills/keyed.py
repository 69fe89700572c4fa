"""Entries whose bytes are a function of their key, so that anything read back can be
verified without knowing which prompt, worker or daemon life wrote it.

A worker that stores a prompt first writes, into the rows it stores from, the bytes
`content(key, kind)` of each page and of the checkpoint; a worker that loads compares
what landed in its rows with the same function. A mismatch is a wrong or incomplete entry
served: the one thing these tests must never see.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
import xxhash

PAGE, CHECKPOINT = b"page", b"checkpoint"


def content(key: bytes, kind: bytes, nbytes: int) -> np.ndarray:
    """The bytes an entry of `kind` stored under `key` must hold."""
    seed = xxhash.xxh3_64_intdigest(kind + bytes(key))
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8)


def byte_rows(tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Buffers (a worker's, by name in layout order, or already uint8 rows) as uint8 rows."""
    values = list(tensors.values()) if isinstance(tensors, Mapping) else list(tensors)
    return [t.reshape(t.shape[0], -1).view(torch.uint8) for t in values]


def write_entry(rows: Sequence[torch.Tensor], row: int, data: np.ndarray) -> None:
    """Spread one entry's bytes over row `row` of every buffer, in layout order."""
    at = 0
    for buffer in rows:
        width = buffer.shape[1]
        buffer[row] = torch.from_numpy(data[at:at + width].copy())
        at += width


def read_entry(rows: Sequence[torch.Tensor], row: int) -> np.ndarray:
    return np.concatenate([buffer[row].numpy() for buffer in rows])


def entry_bytes(rows: Sequence[torch.Tensor]) -> int:
    return sum(buffer.shape[1] for buffer in rows)


def fill(paged: Sequence[torch.Tensor], slots: Sequence[torch.Tensor], keys: Sequence[bytes],
         kv_rows: Sequence[int], slot: int | None) -> None:
    """Write the content of a prompt's pages into `kv_rows` and of the checkpoint at its
    last page into `slot`."""
    for key, row in zip(keys, kv_rows, strict=True):
        write_entry(paged, row, content(key, PAGE, entry_bytes(paged)))
    if slot is not None and slots:
        write_entry(slots, slot, content(keys[-1], CHECKPOINT, entry_bytes(slots)))


def wrong_entries(paged: Sequence[torch.Tensor], slots: Sequence[torch.Tensor],
                  keys: Sequence[bytes], kv_rows: Sequence[int], pages: int,
                  slot: int | None) -> int:
    """How many of the `pages` loaded pages (in `kv_rows`) and of the checkpoint at the
    last of them (in `slot`, if a layout has slot buffers) differ from their content."""
    wrong = sum(not np.array_equal(read_entry(paged, row), content(key, PAGE, entry_bytes(paged)))
                for key, row in zip(keys[:pages], kv_rows[:pages]))
    if pages and slot is not None and slots:
        expected = content(keys[pages - 1], CHECKPOINT, entry_bytes(slots))
        wrong += not np.array_equal(read_entry(slots, slot), expected)
    return wrong


def poison(rows: Sequence[torch.Tensor]) -> None:
    """Fill destination rows with a pattern no content has, so unwritten rows show."""
    for buffer in rows:
        buffer.fill_(0xA5)
