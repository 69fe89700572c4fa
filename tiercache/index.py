"""Which tiers hold which KV pages and checkpoints: a table with one row per entry.

Keys live in a vectorised hash map (keymap.py) and every other field in numpy columns,
so an entry costs about a hundred bytes, a match of thousands of pages is a few numpy
operations and one pass in C over the columns (_index.c, which also finds where a hit's
entries lie), and eviction scores all candidates of a tier in one pass. The index holds
committed entries only: the engine publishes a tier after the bytes are in it
(invariant 1) and pins rows while a load reads them (invariant 3). Not thread-safe: the
engine serialises calls under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import numpy as np

from tiercache import _index
from tiercache.keymap import KeyMap
from tiercache.results import ARENA_TIERS, TIERS, Kind, Match, StopReason, Tier


@dataclass(frozen=True)
class Hit:
    """A match and the index rows behind it (valid under the engine lock or while pinned)."""

    match: Match
    page_rows: np.ndarray
    checkpoint_row: int | None

    @cached_property  # a load asks for them three times
    def rows(self) -> np.ndarray:
        extra = [] if self.checkpoint_row is None else [self.checkpoint_row]
        return np.concatenate([self.page_rows, np.asarray(extra, np.int64)]).astype(np.int64)


@dataclass(frozen=True)
class Candidates:
    """Evictable rows of one tier and the columns a policy scores them by."""

    rows: np.ndarray
    stamp: np.ndarray
    depth: np.ndarray
    kind: np.ndarray
    nbytes: np.ndarray
    value: np.ndarray  # FLOPs saved per byte held, as the engine rated it at store time


ANY_TIER = 0xFF  # `readable` tiers: every one (a bit mask of Tier)


def best_tiers(masks: np.ndarray) -> np.ndarray:
    """The best (lowest) tier bit of each mask."""
    masks = masks.astype(np.int16)
    return (masks & -masks).astype(np.uint8)


def _best_tier(mask: int) -> Tier:
    return Tier(mask & -mask)


class Index:
    _DTYPES = {"kind": np.uint8, "tiers": np.uint8, "pins": np.uint32, "depth": np.uint32,
               "nbytes": np.int64, "stamp": np.uint64, "slot_1": np.int32, "slot_2": np.int32,
               "key_lo": np.uint64, "key_hi": np.uint64, "value": np.float32,
               "check": np.uint64, "shared": np.uint8}

    def __init__(self, capacity: int = 1024) -> None:
        self._maps = (KeyMap(), KeyMap())  # by Kind
        self._free = np.empty(0, np.int64)  # a stack of rows in no use: the top at _n_free - 1
        self._n_free = 0
        self._clock = 0
        self._cols: dict[str, np.ndarray] = {}
        self._capacity = 0
        self._grow(capacity)
        self.count = {t: 0 for t in TIERS}
        self.bytes = {t: 0 for t in TIERS}
        self.collisions = 0  # keys found whose entry's check did not match: misses
        self.foreign = 0  # keys found whose entry has another size (another layout): misses
        # told (entered: bool, kinds, tier, keys) of every entry entering or leaving a tier,
        # under the engine lock: for KV events (tiercache.events), which only append
        self.observer: Callable[[bool, np.ndarray, Tier, np.ndarray], None] | None = None

    def _grow(self, capacity: int) -> None:
        old = self._capacity
        for name, dtype in self._DTYPES.items():
            col = np.zeros(capacity, dtype)
            if name in self._cols:
                col[:old] = self._cols[name][:old]
            self._cols[name] = col
        free = np.empty(capacity, np.int64)  # room for every row: no push outgrows it
        free[:self._n_free] = self._free[:self._n_free]
        free[self._n_free:self._n_free + capacity - old] = np.arange(capacity - 1, old - 1, -1)
        self._free, self._n_free = free, self._n_free + capacity - old  # low rows on top
        self._capacity = capacity

    @property
    def free_rows(self) -> np.ndarray:
        """The rows in no use (a copy)."""
        return self._free[:self._n_free].copy()

    def _slot_column(self, tier: Tier) -> np.ndarray:
        return self._cols[f"slot_{int(tier)}"]

    def __len__(self) -> int:
        return len(self._maps[0]) + len(self._maps[1])

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- lookups --------------------------------------------------------------------
    def rows_of(self, kind: Kind, keys: np.ndarray) -> np.ndarray:
        """The row of each key (uint64 array (n, 2)), -1 where absent."""
        return self._maps[kind].lookup(keys)

    def keys(self, rows: np.ndarray) -> np.ndarray:
        """The keys of rows, as a uint64 array (n, 2)."""
        return np.stack([self._cols["key_lo"][rows], self._cols["key_hi"][rows]], axis=1)

    def column(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Values of one column (kind, tiers, pins, depth, nbytes, stamp, value) at `rows`."""
        return self._cols[name][rows]

    def slots(self, rows: np.ndarray, tier: Tier) -> np.ndarray:
        return self._slot_column(tier)[rows].astype(np.int64)

    def locate(self, rows: np.ndarray, device_ok: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Where entries `rows` lie: (in the device tier, if `device_ok`: bool per row; the
        device slots of those; per row its host slot if in the host tier and not on the
        device, else -1; the positions of the rows in neither, which only the disk holds)."""
        n = len(rows)
        on_device, host, device, disk = (np.empty(n, bool), np.empty(n, np.int64),
                                         np.empty(n, np.int64), np.empty(n, np.int64))
        devices, disks = _index.locate(np.ascontiguousarray(rows, np.int64), self._cols["tiers"],
                                       self._slot_column(Tier.HOST), self._slot_column(Tier.DEVICE),
                                       device_ok, on_device, host, device, disk)
        return on_device, device[:devices], host, disk[:disks]

    def in_tier(self, rows: np.ndarray, tier: Tier) -> np.ndarray:
        return (self._cols["tiers"][rows] & int(tier)) != 0

    def usable(self, rows: np.ndarray, nbytes: int, checks: np.ndarray | None = None,
               readable: int = ANY_TIER) -> np.ndarray:
        """`rows` (of keys looked up), with -1 where the entry cannot serve this caller: it
        is in none of the tiers `readable` to it (a bit mask of Tier), it is not `nbytes`
        long (an entry of another layout under the same key: reading it would hand over
        bytes the caller's namespace never stored, invariant 5), or its check differs from
        the caller's (another prompt under the same key, a collision). An entry stored
        without checks (0: its caller gave keys, not tokens) has no check to compare."""
        return self._usable(rows, nbytes, checks, readable)[0]

    def _usable(self, rows: np.ndarray, nbytes: int, checks: np.ndarray | None,
                readable: int) -> tuple[np.ndarray, int]:
        """`usable`, and the first position it marks -1 (len(rows) if none)."""
        if not len(rows):
            return rows, 0
        out = np.empty(len(rows), np.int64)
        cols = self._cols
        given = None if checks is None else np.ascontiguousarray(checks, np.uint64)
        first, foreign, collisions = _index.usable(np.ascontiguousarray(rows, np.int64), out,
                                                   cols["tiers"], cols["nbytes"], cols["check"],
                                                   nbytes, given, readable)
        self.foreign += foreign
        self.collisions += collisions
        return out, first

    def _usable_one(self, row: int, nbytes: int, check: int | None, readable: int = ANY_TIER) -> bool:
        """`usable` of one row, on Python numbers (a dozen numpy calls less)."""
        if row < 0 or not self._cols["tiers"][row] & readable:
            return False
        if self._cols["nbytes"][row] != nbytes:
            self.foreign += 1
            return False
        stored = int(self._cols["check"][row])
        if check is not None and stored and stored != check:
            self.collisions += 1
            return False
        return True

    def held(self, keys: np.ndarray, page_bytes: int, checkpoint_bytes: int,
             checks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per key: whether a usable page is held (every key, without paged buffers), its
        best tier (0 if none), whether a usable checkpoint is held, its best tier. The rule
        of `usable`, without counting (the match that came first counted its misses)."""
        def usable(kind: Kind, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
            rows = self._maps[kind].lookup(keys)
            at = np.maximum(rows, 0)
            ok = (rows >= 0) & (self._cols["tiers"][at] != 0) & (self._cols["nbytes"][at] == nbytes)
            if checks is not None:
                stored = self._cols["check"][at]
                ok &= (stored == 0) | (stored == checks)
            return ok, np.where(ok, best_tiers(self._cols["tiers"][at]), 0)
        n = len(keys)
        pages = usable(Kind.PAGE, page_bytes) if page_bytes else (np.ones(n, bool), np.zeros(n, np.uint8))
        marks = (usable(Kind.CHECKPOINT, checkpoint_bytes) if checkpoint_bytes
                 else (np.zeros(n, bool), np.zeros(n, np.uint8)))
        return pages[0], pages[1], marks[0], marks[1]

    def match(self, keys: np.ndarray, page_tokens: int, page_bytes: int, checkpoint_bytes: int,
              checks: np.ndarray | None = None, readable: int = ANY_TIER) -> Hit:
        """Largest n with pages k_1..k_n in some tier and a checkpoint at k_n, of entries of
        the caller's sizes (0 bytes: the layout has no such entries and needs none). With
        `checks` (one per key), an entry whose check differs counts as missing; so does one
        in none of the tiers `readable` to the caller (a bit mask of Tier)."""
        if page_bytes:
            page_rows, walked = self._usable(self._maps[Kind.PAGE].lookup(keys), page_bytes, checks,
                                             readable)
        else:
            page_rows, walked = np.empty(0, np.int64), len(keys)
        pages, checkpoint_row = walked, None
        if checkpoint_bytes:
            pages, checkpoint_row = self._deepest_checkpoint(
                keys[:walked], checkpoint_bytes, None if checks is None else checks[:walked], readable)
        rows = page_rows[:pages] if page_bytes else page_rows
        if pages == len(keys):
            stop = StopReason.END_OF_PROMPT
        elif pages == walked:
            stop = StopReason.MISSING_PAGE
        else:
            stop = StopReason.NO_CHECKPOINT
        tiers = self._cols["tiers"]
        match = Match(
            pages=pages, tokens=pages * page_tokens, prompt_pages=len(keys),
            tier_codes=best_tiers(tiers[rows] & readable).tobytes(),
            checkpoint_tier=None if checkpoint_row is None else _best_tier(int(tiers[checkpoint_row]) & readable),
            stop=stop, kv_pages=walked if page_bytes else pages)
        return Hit(match, rows, checkpoint_row)

    def _deepest_checkpoint(self, keys: np.ndarray, nbytes: int, checks: np.ndarray | None,
                            readable: int = ANY_TIER) -> tuple[int, int | None]:
        """(pages, row) of the checkpoint at the deepest of `keys` that has one; (0, None)."""
        checkpoints = self._maps[Kind.CHECKPOINT]
        if not len(keys):
            return 0, None
        last = checkpoints.get(keys[-1])
        if self._usable_one(last, nbytes, None if checks is None else int(checks[-1]), readable):
            return len(keys), last  # the usual case: the hit ends at a checkpoint
        rows = self.usable(checkpoints.lookup(keys[:-1]), nbytes,
                           None if checks is None else checks[:-1], readable)
        found = np.flatnonzero(rows >= 0)
        return (0, None) if not found.size else (int(found[-1]) + 1, int(rows[found[-1]]))

    # -- updates ----------------------------------------------------------------------
    def publish(self, kind: Kind, keys: np.ndarray, depths: Sequence[int], nbytes: int,
                tier: Tier, slots: Sequence[int] | None = None, stamp: int | None = None,
                values: np.ndarray | None = None, checks: np.ndarray | None = None) -> np.ndarray:
        """Make `keys` (distinct) visible in `tier`; call only once their bytes are all there.
        `values` rate the entries for eviction (0 if not given; see `raise_values`); `checks`
        are what a match must bring to hit a new entry (0 if not given)."""
        rows = self._maps[kind].lookup(keys)
        if np.any(self._cols["nbytes"][rows[rows >= 0]] != nbytes):
            raise ValueError(f"an entry among {len(keys)} keys is not {nbytes} bytes")
        new = np.flatnonzero(rows < 0)
        if len(new):
            rows[new] = self._new_rows(kind, keys[new], np.asarray(depths, np.int64)[new], nbytes,
                                       None if checks is None else np.asarray(checks, np.uint64)[new])
        if values is not None:
            self.raise_values(rows, values)
        self.add_tier(rows, tier, slots, self._clock if stamp is None else stamp)
        return rows

    def claim(self, kind: Kind, keys: np.ndarray, depths: np.ndarray, nbytes: int,
              checks: np.ndarray | None) -> np.ndarray:
        """Rows for entries a store is about to write (`keys` absent and distinct): in the
        index, so no other store writes them too, but in no tier, so no match sees them
        (`usable`) until `add_tier` publishes them; `release` drops those never published."""
        return self._new_rows(kind, keys, depths, nbytes, checks)

    def share(self, rows: np.ndarray) -> None:
        """Mark entries that may be written to the remote tier when they leave this node
        (stores of tenants and models not kept local)."""
        self._cols["shared"][rows] = 1

    def release(self, rows: np.ndarray) -> None:
        """Drop claimed rows that were never published."""
        assert not np.any(self._cols["tiers"][rows]), "a released row was published"
        self._drop(rows)

    def _new_rows(self, kind: Kind, keys: np.ndarray, depths: np.ndarray, nbytes: int,
                  checks: np.ndarray | None) -> np.ndarray:
        if not len(keys):
            return np.empty(0, np.int64)
        if len(keys) > self._n_free:
            self._grow(max(2 * self._capacity, self._capacity + len(keys)))
        fresh = self._free[self._n_free - len(keys):self._n_free][::-1].copy()
        # the callers looked the keys up under the same lock: absent; repeats are refused
        self._maps[kind].insert(keys, fresh, looked_up=True)
        self._n_free -= len(keys)
        cols = self._cols
        cols["kind"][fresh] = int(kind)
        cols["tiers"][fresh] = 0
        cols["pins"][fresh] = 0
        cols["depth"][fresh] = depths
        cols["nbytes"][fresh] = nbytes
        cols["key_lo"][fresh], cols["key_hi"][fresh] = keys[:, 0], keys[:, 1]
        cols["value"][fresh] = 0
        cols["check"][fresh] = 0 if checks is None else checks
        cols["shared"][fresh] = 0
        return fresh

    def add_tier(self, rows: np.ndarray, tier: Tier, slots: Sequence[int] | None = None,
                 stamp: int | None = None) -> None:
        """Make entries already in the index visible in one more tier. Their last use stays
        as it was unless `stamp` is given: a copy between tiers is not a use."""
        bit, cols = int(tier), self._cols
        if np.any(cols["tiers"][rows] & bit):
            raise ValueError(f"an entry is already published in {tier.name}")
        cols["tiers"][rows] |= bit
        if tier in ARENA_TIERS:
            assert slots is not None and len(slots) == len(rows), f"{tier.name} entries need slots"
            self._slot_column(tier)[rows] = slots
        if stamp is not None:
            cols["stamp"][rows] = stamp
        self.count[tier] += len(rows)
        self.bytes[tier] += int(cols["nbytes"][rows].sum())
        if self.observer is not None and len(rows):
            self.observer(True, cols["kind"][rows], tier, self.keys(rows))

    def unpublish(self, rows: np.ndarray, tier: Tier) -> None:
        """Remove `tier` from entries; an entry left in no tier leaves the index."""
        bit, cols = int(tier), self._cols
        assert np.all(cols["tiers"][rows] & bit), f"a row is not in {tier.name}"
        assert not np.any(cols["pins"][rows]), "a row is pinned by a load"
        if self.observer is not None and len(rows):
            self.observer(False, cols["kind"][rows], tier, self.keys(rows))
        cols["tiers"][rows] &= ~np.uint8(bit)
        self.count[tier] -= len(rows)
        self.bytes[tier] -= int(cols["nbytes"][rows].sum())
        self._drop(rows[cols["tiers"][rows] == 0])

    def _drop(self, gone: np.ndarray) -> None:
        """Rows in no tier leave the index."""
        for kind in Kind:
            leaving = gone[self._cols["kind"][gone] == kind]
            if len(leaving):
                self._maps[kind].delete(self.keys(leaving))
        self._free[self._n_free:self._n_free + len(gone)] = gone
        self._n_free += len(gone)

    def raise_values(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Rate entries (distinct rows) at least `values`: an entry shared by several prompts
        keeps the best rating any of them gave it."""
        column = self._cols["value"]
        column[rows] = np.maximum(column[rows], np.asarray(values, np.float32))

    def touch(self, rows: np.ndarray, stamp: int | None = None) -> None:
        """Mark rows as used now (or at `stamp`). Of rows used together, deeper ones are
        evicted first."""
        column = self._cols["stamp"]
        # a use at `stamp` never makes an entry look older than a later use did
        column[rows] = self.tick() if stamp is None else np.maximum(column[rows], stamp)

    def pin(self, rows: np.ndarray) -> None:
        """Pin `rows` (distinct, as the rows of distinct keys are: plain indexing, which
        is many times faster than np.add.at)."""
        self._cols["pins"][rows] += 1

    def unpin(self, rows: np.ndarray) -> None:
        pins = self._cols["pins"]
        assert np.all(pins[rows] > 0), "unpin of a row that is not pinned"
        pins[rows] -= 1

    def candidates(self, tier: Tier, nbytes: int | None = None) -> Candidates:
        """Unpinned rows in `tier` (of one entry size, if given)."""
        cols = self._cols
        mask = ((cols["tiers"] & int(tier)) != 0) & (cols["pins"] == 0)
        if nbytes is not None:
            mask &= cols["nbytes"] == nbytes
        rows = np.flatnonzero(mask)
        return Candidates(rows, cols["stamp"][rows], cols["depth"][rows],
                          cols["kind"][rows], cols["nbytes"][rows], cols["value"][rows])

    def rows_in(self, tier: Tier) -> np.ndarray:
        return np.flatnonzero((self._cols["tiers"] & int(tier)) != 0)
