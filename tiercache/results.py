"""The words of the engine's answers: tiers, kinds of entry, matches and what its calls
return. Typed results, no sentinels; nothing here moves bytes, so the wire converter and
the remote client import this without loading the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Tier(enum.IntFlag):
    DEVICE = 1
    HOST = 2
    DISK = 4
    REMOTE = 8  # the shared remote tier: in match results only, never in the index


TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)  # best first
ARENA_TIERS = (Tier.DEVICE, Tier.HOST)  # tiers that address entries by slot


class Kind(enum.IntEnum):
    PAGE = 0
    CHECKPOINT = 1


class StopReason(enum.Enum):
    END_OF_PROMPT = "end_of_prompt"  # every full page of the prompt hit
    MISSING_PAGE = "missing_page"  # the next KV page is in no tier
    NO_CHECKPOINT = "no_checkpoint"  # KV pages go on, but no checkpoint further on
    GROUP_INCOMPLETE = "group_incomplete"  # a rank of the group is missing: no hit at all


@dataclass(frozen=True)
class Match:
    """The longest hybrid match of a prompt."""

    pages: int  # matched pages
    tokens: int  # matched tokens = pages * page_tokens
    prompt_pages: int  # full pages in the prompt
    tier_codes: bytes  # best tier of each matched page, one Tier value a byte (none without paged buffers)
    checkpoint_tier: Tier | None  # best tier of the checkpoint at the last page, if one is needed
    stop: StopReason
    # Leading pages whose KV pages are cached, checkpoint or not (>= pages; as many as
    # `pages` without paged buffers): a checkpoint there would extend the hit to them.
    kv_pages: int = 0

    @property
    def page_tiers(self) -> tuple[Tier, ...]:
        return tuple(Tier(code) for code in self.tier_codes)



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


@dataclass(frozen=True)
class CacheStats:
    """What a Stats call answers: the tiers, the counters by flat name, workers registered."""

    tiers: tuple[TierStats, ...]
    counters: dict[str, int]
    workers: int
