"""A hash map from 128-bit keys to rows, where every operation works on a whole batch.

Open addressing with linear probing over one (capacity, 3) uint64 table of (lo, hi,
row + 2) records, so a probe costs one cache miss; 0 in the last field marks an empty
slot and 1 a deleted one (a tombstone, cleared by the next rehash). A key's first slot is
a salted hash of both halves, salts drawn at random for each map: keys come from
clients, and keys chosen to share a slot would make every probe long. The probing loops
are C (tiercache/_keymap.c, built when the package is installed): a lookup of the 2,048
keys of a 32k-token prompt takes a few microseconds, a tenth of what numpy's per-call
costs made of it. This module owns the table, its size and its accounting. An entry
costs about 40 bytes instead of a dict slot plus a bytes object.
"""

from __future__ import annotations

import secrets

import numpy as np

try:
    from tiercache import _keymap
except ImportError as error:  # a source tree nobody built
    raise ImportError("tiercache._keymap (C) is not built: install the package (pip install -e .) "
                      "or build it in place (python setup.py build_ext --inplace)") from error

_BASE = 2  # a live record stores row + 2; 0 is an empty slot, 1 a tombstone
_MIN_CAPACITY = 1024


class DuplicateKey(ValueError):
    """An insert named a key twice, or a key the map holds already."""

    def __init__(self, position: int, why: str) -> None:
        super().__init__(f"key {position} of the batch {why}")
        self.position = position


def salts() -> tuple[int, int]:
    """Two odd 64-bit salts for a table's hash, at random (see _keymap.c)."""
    return secrets.randbits(64) | 1, secrets.randbits(64) | 1


def _contiguous(keys: np.ndarray) -> np.ndarray:
    """Keys as the C loops read them: a C-contiguous uint64 (n, 2) array."""
    if keys.ndim != 2 or keys.shape[1] != 2 or keys.dtype != np.uint64:
        raise ValueError(f"keys are a uint64 (n, 2) array, got {keys.dtype} {keys.shape}")
    return np.ascontiguousarray(keys)


class KeyMap:
    def __init__(self, capacity: int = _MIN_CAPACITY) -> None:
        self.count = 0
        self._tombstones = 0
        self._salts = salts()
        self._allocate(max(_MIN_CAPACITY, 1 << (capacity - 1).bit_length()))

    def _allocate(self, capacity: int) -> None:
        self._table = np.zeros((capacity, 3), np.uint64)
        self._mask = capacity - 1

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The row of each key (n, 2), or -1 where a key is absent."""
        return self._find(keys)[1]

    def get(self, key: np.ndarray) -> int:
        """The row of one key (a uint64 pair), or -1."""
        lo, hi = key.tolist()
        return _keymap.get(self._table, self._mask, *self._salts, lo, hi)

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(table slot, row) of each key; both -1 where it is absent."""
        slots, rows = np.empty(len(keys), np.int64), np.empty(len(keys), np.int64)
        _keymap.find(self._table, self._mask, *self._salts, _contiguous(keys), slots, rows)
        return slots, rows

    def insert(self, keys: np.ndarray, rows: np.ndarray, looked_up: bool = False) -> None:
        """Add keys, each mapping to its row. Every key must be absent and distinct: a key
        present already or repeated in the batch raises DuplicateKey, and the map stays as
        it was (two records of one key would let one of them outlive its row).
        `looked_up`: the caller found every key absent, with no change to the map since;
        then only repeats within the batch are looked for."""
        keys = _contiguous(keys)
        rows = np.ascontiguousarray(rows, np.int64)
        if len(rows) != len(keys):
            raise ValueError(f"{len(keys)} keys with {len(rows)} rows")
        if len(keys) and rows.min() < 0:
            raise ValueError("rows are >= 0")
        self._make_room(len(keys))
        position, why, taken = _keymap.insert(self._table, self._mask, *self._salts, keys, rows,
                                              looked_up)
        if position >= 0:
            raise DuplicateKey(position, "is in the map already" if why == 1
                               else "repeats an earlier key of the batch")
        self._tombstones -= taken
        self.count += len(keys)

    def delete(self, keys: np.ndarray) -> None:
        """Remove keys that are present (each once)."""
        slots = self._find(keys)[0]
        assert np.all(slots >= 0), "delete of an absent key"
        self._tombstones += len(keys) - _keymap.delete(self._table, self._mask, slots)
        self.count -= len(keys)

    def _make_room(self, extra: int) -> None:
        """Keep the table at most half full (tombstones count), rehashing when needed."""
        if 2 * (self.count + self._tombstones + extra) <= len(self._table):
            return
        live = self._table[self._table[:, 2] >= _BASE]
        keys, rows = live[:, :2], live[:, 2].astype(np.int64) - _BASE
        wanted = 1 << max(10, (4 * (self.count + extra) - 1).bit_length())
        self._allocate(wanted)
        self.count = self._tombstones = 0
        if len(live):
            self.insert(keys, rows, looked_up=True)
