"""What the engine's calls return: typed results, no sentinels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiercache.index import Match, Tier


@dataclass(frozen=True)
class StoreResult:
    stored: int  # entries written now
    present: int  # entries that were cached already (their last use is refreshed)
    skipped: int  # entries left out for lack of room
    checkpoints: tuple[int, ...] = ()  # page counts whose checkpoint is now cached

    def __add__(self, other: "StoreResult") -> "StoreResult":
        return StoreResult(self.stored + other.stored, self.present + other.present,
                           self.skipped + other.skipped, self.checkpoints + other.checkpoints)


@dataclass(frozen=True)
class LoadResult:
    match: Match  # what is now in the worker's rows
    bytes_from: dict[Tier, int]  # bytes copied out of each tier
    damaged: int  # damaged entries dropped on the way (each one retried the load)
    done: Any = None  # asynchronous GPU loads: the (interprocess) event that marks the bytes in place


@dataclass(frozen=True)
class TierStats:
    tier: Tier
    entries: int
    used_bytes: int
    budget_bytes: int


@dataclass(frozen=True)
class EngineStats:
    tiers: tuple[TierStats, ...]
    counters: dict[str, int]
    alpha: float | None = None  # the FLOP-aware policy's weight now (None for LRU)
