"""Which tiers hold which KV pages and checkpoints: a table with one row per entry.

Columns are numpy arrays, so an entry costs a dict slot, its key and a few dozen bytes,
and eviction scores all candidates of a tier in one vectorised pass. The index holds
committed entries only: the engine publishes a tier after the bytes are in it
(invariant 1) and pins rows while a load reads them (invariant 3). Not thread-safe: the
engine serialises calls under its lock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from tiercache.hashing import PageKey


class Tier(enum.IntFlag):
    DEVICE = 1
    HOST = 2
    DISK = 4


TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)  # best first
ARENA_TIERS = (Tier.DEVICE, Tier.HOST)  # tiers that address entries by slot


class Kind(enum.IntEnum):
    PAGE = 0
    CHECKPOINT = 1


class StopReason(enum.Enum):
    END_OF_PROMPT = "end_of_prompt"  # every full page of the prompt hit
    MISSING_PAGE = "missing_page"  # the next KV page is in no tier
    NO_CHECKPOINT = "no_checkpoint"  # KV pages go on, but no checkpoint further on


@dataclass(frozen=True)
class Match:
    """The longest hybrid match of a prompt."""

    pages: int  # matched pages
    tokens: int  # matched tokens = pages * page_tokens
    prompt_pages: int  # full pages in the prompt
    page_tiers: tuple[Tier, ...]  # best tier of each matched page (empty without paged buffers)
    checkpoint_tier: Tier | None  # best tier of the checkpoint at the last page, if one is needed
    stop: StopReason


@dataclass(frozen=True)
class Hit:
    """A match and the index rows behind it (valid under the engine lock or while pinned)."""

    match: Match
    page_rows: np.ndarray
    checkpoint_row: int | None

    @property
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


def best_tier(mask: int) -> Tier:
    return Tier(mask & -mask)


class Index:
    def __init__(self, capacity: int = 1024) -> None:
        self._rows: tuple[dict[PageKey, int], dict[PageKey, int]] = ({}, {})  # by Kind
        self._keys: list[PageKey | None] = []
        self._free: list[int] = []
        self._clock = 0
        self._cols: dict[str, np.ndarray] = {}
        self._grow(capacity)
        self.count = {t: 0 for t in TIERS}
        self.bytes = {t: 0 for t in TIERS}

    # -- storage ------------------------------------------------------------------
    _DTYPES = {"kind": np.uint8, "tiers": np.uint8, "pins": np.uint32, "depth": np.uint32,
               "nbytes": np.int64, "stamp": np.uint64, "slot_1": np.int32, "slot_2": np.int32}

    def _grow(self, capacity: int) -> None:
        old = len(self._keys)
        for name, dtype in self._DTYPES.items():
            col = np.zeros(capacity, dtype)
            if name in self._cols:
                col[:old] = self._cols[name][:old]
            self._cols[name] = col
        self._keys.extend([None] * (capacity - old))
        self._free.extend(range(capacity - 1, old - 1, -1))  # pop() hands out low rows first

    def _slot_column(self, tier: Tier) -> np.ndarray:
        return self._cols[f"slot_{int(tier)}"]

    def __len__(self) -> int:
        return len(self._rows[0]) + len(self._rows[1])

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- lookups --------------------------------------------------------------------
    def row(self, kind: Kind, key: PageKey) -> int | None:
        return self._rows[kind].get(key)

    def rows_of(self, kind: Kind, keys: Iterable[PageKey]) -> list[int | None]:
        get = self._rows[kind].get
        return [get(k) for k in keys]

    def keys(self, rows: Iterable[int]) -> list[PageKey]:
        found = [self._keys[int(r)] for r in rows]
        assert all(k is not None for k in found), "a row is free"
        return found  # type: ignore[return-value]

    def column(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Values of one column (kind, tiers, pins, depth, nbytes, stamp) at `rows`."""
        return self._cols[name][rows]

    def slots(self, rows: np.ndarray, tier: Tier) -> np.ndarray:
        return self._slot_column(tier)[rows].astype(np.int64)

    def in_tier(self, rows: np.ndarray, tier: Tier) -> np.ndarray:
        return (self._cols["tiers"][rows] & int(tier)) != 0

    def match(self, keys: Sequence[PageKey], page_tokens: int,
              needs_pages: bool, needs_checkpoint: bool) -> Hit:
        """Largest n with pages k_1..k_n in some tier and, if needed, a checkpoint at k_n."""
        page_rows: list[int] = []
        if needs_pages:
            get = self._rows[Kind.PAGE].get
            for key in keys:
                row = get(key)
                if row is None:
                    break
                page_rows.append(row)
            walked = len(page_rows)
        else:
            walked = len(keys)
        pages, checkpoint_row = walked, None
        if needs_checkpoint:
            get = self._rows[Kind.CHECKPOINT].get
            pages = 0
            for n in range(walked, 0, -1):
                checkpoint_row = get(keys[n - 1])
                if checkpoint_row is not None:
                    pages = n
                    break
        rows = np.asarray(page_rows[:pages], np.int64)
        tiers = self._cols["tiers"][rows]
        if pages == len(keys):
            stop = StopReason.END_OF_PROMPT
        elif pages == walked:
            stop = StopReason.MISSING_PAGE
        else:
            stop = StopReason.NO_CHECKPOINT
        match = Match(
            pages=pages, tokens=pages * page_tokens, prompt_pages=len(keys),
            page_tiers=tuple(best_tier(int(t)) for t in tiers),
            checkpoint_tier=None if checkpoint_row is None else best_tier(
                int(self._cols["tiers"][checkpoint_row])),
            stop=stop)
        return Hit(match, rows, checkpoint_row)

    # -- updates ----------------------------------------------------------------------
    def publish(self, kind: Kind, keys: Sequence[PageKey], depths: Sequence[int], nbytes: int,
                tier: Tier, slots: Sequence[int] | None = None, stamp: int | None = None) -> np.ndarray:
        """Make `keys` visible in `tier`; call only once their bytes are completely there."""
        kind, bit = int(kind), int(tier)
        table, cols = self._rows[kind], self._cols
        rows = np.empty(len(keys), np.int64)
        new = []
        for i, key in enumerate(keys):
            row = table.get(key)
            if row is None:
                if not self._free:
                    self._grow(2 * len(self._keys))
                row = self._free.pop()
                table[key] = row
                self._keys[row] = key
                new.append(i)
            rows[i] = row
        fresh = rows[new]
        cols["kind"][fresh] = kind
        cols["tiers"][fresh] = 0
        cols["pins"][fresh] = 0
        cols["depth"][fresh] = np.asarray(depths, np.int64)[new]
        cols["nbytes"][fresh] = nbytes
        if np.any(cols["nbytes"][rows] != nbytes):
            raise ValueError(f"an entry among {len(keys)} keys is not {nbytes} bytes")
        self.add_tier(rows, tier, slots, stamp)
        return rows

    def add_tier(self, rows: np.ndarray, tier: Tier, slots: Sequence[int] | None = None,
                 stamp: int | None = None) -> None:
        """Make entries already in the index visible in one more tier."""
        bit, cols = int(tier), self._cols
        if np.any(cols["tiers"][rows] & bit):
            raise ValueError(f"an entry is already published in {tier.name}")
        cols["tiers"][rows] |= bit
        if tier in ARENA_TIERS:
            assert slots is not None and len(slots) == len(rows), f"{tier.name} entries need slots"
            self._slot_column(tier)[rows] = slots
        cols["stamp"][rows] = self._clock if stamp is None else stamp
        self.count[tier] += len(rows)
        self.bytes[tier] += int(cols["nbytes"][rows].sum())

    def unpublish(self, rows: np.ndarray, tier: Tier) -> None:
        """Remove `tier` from entries; an entry left in no tier leaves the index."""
        bit, cols = int(tier), self._cols
        assert np.all(cols["tiers"][rows] & bit), f"a row is not in {tier.name}"
        assert not np.any(cols["pins"][rows]), "a row is pinned by a load"
        cols["tiers"][rows] &= ~np.uint8(bit)
        self.count[tier] -= len(rows)
        self.bytes[tier] -= int(cols["nbytes"][rows].sum())
        for row in rows[cols["tiers"][rows] == 0].tolist():
            key = self._keys[row]
            assert key is not None
            del self._rows[int(cols["kind"][row])][key]
            self._keys[row] = None
            self._free.append(row)

    def touch(self, rows: np.ndarray) -> None:
        """Mark rows as used now. Of rows used together, deeper ones are evicted first."""
        self._cols["stamp"][rows] = self.tick()

    def pin(self, rows: np.ndarray) -> None:
        np.add.at(self._cols["pins"], rows, 1)

    def unpin(self, rows: np.ndarray) -> None:
        pins = self._cols["pins"]
        assert np.all(pins[rows] > 0), "unpin of a row that is not pinned"
        np.subtract.at(pins, rows, 1)


    def candidates(self, tier: Tier, nbytes: int | None = None) -> Candidates:
        """Unpinned rows in `tier` (of one entry size, if given)."""
        cols = self._cols
        mask = ((cols["tiers"] & int(tier)) != 0) & (cols["pins"] == 0)
        if nbytes is not None:
            mask &= cols["nbytes"] == nbytes
        rows = np.flatnonzero(mask)
        return Candidates(rows, cols["stamp"][rows], cols["depth"][rows],
                          cols["kind"][rows], cols["nbytes"][rows])

    def rows_in(self, tier: Tier) -> np.ndarray:
        return np.flatnonzero((self._cols["tiers"] & int(tier)) != 0)
