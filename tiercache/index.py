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

    def _col(self, name: str) -> np.ndarray:
        return self._cols[name]

    def slot_column(self, tier: Tier) -> np.ndarray:
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

    def key(self, row: int) -> PageKey:
        key = self._keys[row]
        assert key is not None, f"row {row} is free"
        return key

    def tiers(self, row: int) -> Tier:
        return Tier(int(self._cols["tiers"][row]))

    def kind(self, row: int) -> Kind:
        return Kind(int(self._cols["kind"][row]))

    def depth(self, row: int) -> int:
        return int(self._cols["depth"][row])

    def nbytes(self, row: int) -> int:
        return int(self._cols["nbytes"][row])

    def slot(self, row: int, tier: Tier) -> int:
        return int(self.slot_column(tier)[row])

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
    def publish(self, kind: Kind, key: PageKey, depth: int, nbytes: int, tier: Tier,
                slot: int | None = None, stamp: int | None = None) -> int:
        """Make `key` visible in `tier`; call only once its bytes are completely there."""
        rows = self._rows[kind]
        row = rows.get(key)
        cols = self._cols
        if row is None:
            if not self._free:
                self._grow(2 * len(self._keys))
            row = self._free.pop()
            rows[key] = row
            self._keys[row] = key
            cols["kind"][row] = kind
            cols["tiers"][row] = 0
            cols["pins"][row] = 0
            cols["depth"][row] = depth
            cols["nbytes"][row] = nbytes
        elif cols["nbytes"][row] != nbytes:
            raise ValueError(f"entry {key.hex()} is {cols['nbytes'][row]} bytes, not {nbytes}")
        if cols["tiers"][row] & tier:
            raise ValueError(f"entry {key.hex()} is already published in {tier.name}")
        cols["tiers"][row] |= tier
        if tier in ARENA_TIERS:
            assert slot is not None, f"{tier.name} entries need a slot"
            self.slot_column(tier)[row] = slot
        cols["stamp"][row] = self._clock if stamp is None else stamp
        self.count[tier] += 1
        self.bytes[tier] += nbytes
        return row

    def unpublish(self, row: int, tier: Tier) -> None:
        """Remove `tier` from an entry; an entry left in no tier leaves the index."""
        cols = self._cols
        assert cols["tiers"][row] & tier, f"row {row} is not in {tier.name}"
        assert cols["pins"][row] == 0, f"row {row} is pinned by a load"
        cols["tiers"][row] &= ~np.uint8(tier)
        self.count[tier] -= 1
        self.bytes[tier] -= int(cols["nbytes"][row])
        if cols["tiers"][row] == 0:
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

    def pinned(self, row: int) -> bool:
        return bool(self._cols["pins"][row])

    def candidates(self, tier: Tier, nbytes: int | None = None) -> Candidates:
        """Unpinned rows in `tier` (of one entry size, if given)."""
        cols = self._cols
        mask = ((cols["tiers"] & tier) != 0) & (cols["pins"] == 0)
        if nbytes is not None:
            mask &= cols["nbytes"] == nbytes
        rows = np.flatnonzero(mask)
        return Candidates(rows, cols["stamp"][rows], cols["depth"][rows],
                          cols["kind"][rows], cols["nbytes"][rows])

    def rows_in(self, tier: Tier) -> np.ndarray:
        return np.flatnonzero((self._cols["tiers"] & tier) != 0)

    def memory_bytes(self) -> int:
        """Bytes held by the columns and the key list (the dicts are not counted here)."""
        return sum(c.nbytes for c in self._cols.values()) + 8 * len(self._keys)
