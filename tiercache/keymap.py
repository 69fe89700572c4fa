"""A hash map from 128-bit keys to rows, where every operation works on a whole batch.

Keys are xxh3/blake2b digests, uniformly spread, so their low 64 bits are the hash.
Open addressing with linear probing over one (capacity, 3) uint64 table of (lo, hi,
row + 2) records, so a probe costs one cache miss; 0 in the last field marks an empty
slot and 1 a deleted one (a tombstone, cleared by the next rehash). A lookup of the 2048 keys of a 32k-token prompt is a few
dozen numpy operations instead of 2048 Python dict lookups, and an entry costs about
40 bytes instead of a dict slot plus a bytes object.
"""

from __future__ import annotations

import numpy as np

EMPTY = 0
GONE = 1  # a tombstone: probing goes on past it, inserting may reuse it
_BASE = 2  # a live record stores row + 2
_MARK = np.uint64(1 << 63)  # a free slot an insert round is assigning (never seen outside it)
_TAIL = 48  # keys still probing when this few are left are probed one by one
_MIN_CAPACITY = 1024


class DuplicateKey(ValueError):
    """An insert named a key twice, or a key the map holds already."""

    def __init__(self, position: int, why: str) -> None:
        super().__init__(f"key {position} of the batch {why}")
        self.position = position


def split(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) uint64 halves of keys given as a uint64 array of shape (n, 2)."""
    return keys[:, 0], keys[:, 1]


class KeyMap:
    def __init__(self, capacity: int = _MIN_CAPACITY) -> None:
        self.count = 0
        self._tombstones = 0
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
        """The row of one key (a uint64 pair), or -1: without numpy's per-call overhead."""
        lo, hi = key.tolist()
        return self._probe(lo, hi, lo & self._mask)[1]

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(table slot, row) of each key; both -1 where it is absent."""
        lo, hi = split(keys)
        at = (lo & np.uint64(self._mask)).astype(np.int64)
        records = np.take(self._table, at, axis=0)  # one gather: numpy's fastest
        hit = (records[:, 0] == lo) & (records[:, 1] == hi) & (records[:, 2] >= _BASE)
        slots = np.where(hit, at, -1)
        rows = np.where(hit, records[:, 2].astype(np.int64) - _BASE, -1)
        pending = np.flatnonzero(~hit & (records[:, 2] != EMPTY))  # an empty slot: absent
        at = (at[pending] + 1) & self._mask
        while len(pending) > _TAIL:  # most keys end after a probe or two
            records = np.take(self._table, at, axis=0)
            hit = (records[:, 0] == lo[pending]) & (records[:, 1] == hi[pending]) & (records[:, 2] >= _BASE)
            slots[pending[hit]] = at[hit]
            rows[pending[hit]] = records[hit, 2].astype(np.int64) - _BASE
            going = ~hit & (records[:, 2] != EMPTY)
            pending, at = pending[going], (at[going] + 1) & self._mask
        for key, start in zip(pending.tolist(), at.tolist()):  # the few long probes, one by one
            slots[key], rows[key] = self._probe(int(lo[key]), int(hi[key]), start)
        return slots, rows

    def _probe(self, lo: int, hi: int, at: int) -> tuple[int, int]:
        while True:
            record_lo, record_hi, row = self._table[at].tolist()
            if row >= _BASE and record_lo == lo and record_hi == hi:
                return at, row - _BASE
            if row == EMPTY:
                return -1, -1
            at = (at + 1) & self._mask

    def insert(self, keys: np.ndarray, rows: np.ndarray, looked_up: bool = False) -> None:
        """Add keys, each mapping to its row. Every key must be absent and distinct: a key
        present already or repeated in the batch raises DuplicateKey, and the map stays as
        it was (two records of one key would let one of them outlive its row).
        `looked_up`: the caller found every key absent, with no change to the map since;
        then only repeats within the batch are looked for."""
        present = np.flatnonzero(self._find(keys)[0] >= 0) if not looked_up else ()
        if len(present):
            raise DuplicateKey(int(present[0]), "is in the map already")
        self._make_room(len(keys))
        lo, hi = split(keys)
        rows = np.asarray(rows, np.int64)
        pending = np.arange(len(keys))
        at = (lo & np.uint64(self._mask)).astype(np.int64)
        written: list[tuple[np.ndarray, np.ndarray]] = []  # (slots, what they held), to undo
        # the table's columns as views: fancy indexing one is about twice as fast
        key_lo, key_hi, state = self._table[:, 0], self._table[:, 1], self._table[:, 2]
        while pending.size:
            free = np.flatnonzero(state[at] < _BASE)
            # several keys may reach the same free slot: each marks it, and the mark that
            # stays takes it (no sort); marked in reverse, so the earliest key wins
            slots = at[free]
            held = state[slots]
            marks = _MARK | free.astype(np.uint64)
            state[slots[::-1]] = marks[::-1]
            won = state[slots] == marks
            winners, taken = pending[free[won]], slots[won]
            written.append((taken, held[won]))
            self._tombstones -= int(np.count_nonzero(held[won] == GONE))
            key_lo[taken], key_hi[taken] = lo[winners], hi[winners]
            state[taken] = rows[winners] + _BASE
            going = np.ones(len(pending), bool)
            going[free[won]] = False
            pending, at = pending[going], at[going]
            # a key that lost its slot to the same key is a repeat within the batch
            repeat = (key_lo[at] == lo[pending]) & (key_hi[at] == hi[pending])
            if repeat.any():
                self._undo(written)
                raise DuplicateKey(int(pending[repeat][0]), "repeats an earlier key of the batch")
            at = (at + 1) & self._mask
            if len(pending) <= _TAIL:  # the few long probes, one by one
                self._insert_each(pending, at, lo, hi, rows, written)
                break
        self.count += len(keys)

    def _insert_each(self, pending: np.ndarray, at: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                     rows: np.ndarray, written: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Place the keys still probing, each from its `at`, without numpy's per-call cost."""
        table, mask = self._table, self._mask
        taken: list[int] = []
        held_before: list[int] = []
        for key, key_lo, key_hi, row, slot in zip(pending.tolist(), lo[pending].tolist(),
                                                  hi[pending].tolist(), rows[pending].tolist(),
                                                  at.tolist()):
            while True:
                record_lo, record_hi, held = table[slot].tolist()
                if held < _BASE:
                    break
                if record_lo == key_lo and record_hi == key_hi:
                    written.append((np.array(taken, np.int64), np.array(held_before, np.uint64)))
                    self._undo(written)
                    raise DuplicateKey(key, "repeats an earlier key of the batch")
                slot = (slot + 1) & mask
            taken.append(slot)
            held_before.append(held)
            self._tombstones -= held == GONE
            table[slot] = (key_lo, key_hi, row + _BASE)
        written.append((np.array(taken, np.int64), np.array(held_before, np.uint64)))

    def _undo(self, written: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Give slots written by an insert back what they held (empty or a tombstone)."""
        for slots, held in reversed(written):
            self._table[slots, 2] = held
            self._tombstones += int(np.count_nonzero(held == GONE))

    def delete(self, keys: np.ndarray) -> None:
        """Remove keys that are present."""
        slots = self._find(keys)[0]
        assert np.all(slots >= 0), "delete of an absent key"
        table = self._table
        table[slots, 2] = GONE
        self._tombstones += len(keys)
        self.count -= len(keys)
        # a tombstone right before an empty slot ends every probe that reaches it as the
        # empty slot would: it becomes empty, and so, in turn, do the tombstones before it
        # (then later probes stop sooner; after evict-and-store cycles, at their home slot)
        gone = slots
        while len(gone):
            ends = gone[table[(gone + 1) & self._mask, 2] == EMPTY]
            table[ends, 2] = EMPTY
            self._tombstones -= len(ends)
            before = (ends - 1) & self._mask
            gone = before[table[before, 2] == GONE]

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
            self.insert(keys, rows)
