"""Tier policy: the order to evict entries in, which offered checkpoints to keep, when host
entries are copied to disk. One frozen config; eviction strategies are pure functions of
the candidates' columns.

Every touch of a page also touches its ancestors (a match walks through them, a store
names the whole chain), so ordering by last use with deeper entries first among equals
evicts leaves before their parents and keeps the cached prefixes matchable. The FLOP-aware
strategy adds the value the engine rated each entry with when it was stored (FLOPs saved
per byte, admission.py), which never falls from a page to the pages after it: both terms
are non-increasing down a chain, so their sum still evicts leaves first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from tiercache.errors import InvalidArgument
from tiercache.index import Candidates


class EvictionPolicy(Protocol):
    name: ClassVar[str]

    def order(self, candidates: Candidates) -> np.ndarray:
        """Positions into `candidates.rows`, first to evict first."""


@dataclass(frozen=True)
class Lru:
    """Least recently used first; of entries used together, the deepest first."""

    name: ClassVar[str] = "lru"

    def order(self, candidates: Candidates) -> np.ndarray:
        return np.lexsort((-candidates.depth.astype(np.int64), candidates.stamp))


@dataclass(frozen=True)
class FlopAware:
    """Lowest utility first: recency scaled to [0, 1] plus alpha times FLOPs saved per byte
    scaled to [0, 1] (Marconi, MLSys 2025); of equal utilities, the deepest first. With
    alpha 0 it is LRU. Entries stored without a model shape are rated by tokens saved per
    byte instead of FLOPs, so longer hits per byte still rank higher."""

    alpha: float = 2.0
    name: ClassVar[str] = "flop"

    def order(self, candidates: Candidates) -> np.ndarray:
        stamp, value = candidates.stamp.astype(np.float64), candidates.value.astype(np.float64)
        if not len(stamp):
            return np.empty(0, np.int64)
        span = stamp.max() - stamp.min()
        recency = (stamp - stamp.min()) / span if span else np.zeros_like(stamp)
        worth = value / value.max() if value.max() > 0 else np.zeros_like(value)
        return np.lexsort((-candidates.depth.astype(np.int64), recency + self.alpha * worth))


@dataclass(frozen=True)
class AdmissionConfig:
    """Which checkpoints a store keeps of those the worker offers (Engine.store)."""

    offered: str = "policy"  # "all": every one; "policy": the end, branch points, `interval`
    interval: int = 0  # under "policy", also offers at multiples of this many pages (0: none)

    def __post_init__(self) -> None:
        if self.offered not in ("all", "policy"):
            raise InvalidArgument(f"admission.offered {self.offered!r} is unknown: "
                                  "use 'all' or 'policy'")
        if not isinstance(self.interval, int) or self.interval < 0:
            raise InvalidArgument("admission.interval must be a non-negative integer, "
                                  f"got {self.interval!r}")


@dataclass(frozen=True)
class WriteConfig:
    """When host entries are copied to disk; always by the background writer, in batches."""

    host: str = "back"  # "through": right after each store; "back": ahead of their eviction
    batch_entries: int = 256  # most entries one LMDB transaction takes
    clean_ahead: float = 0.05  # write-back: the coldest share of the host budget kept on disk too

    def __post_init__(self) -> None:
        if self.host not in ("back", "through"):
            raise InvalidArgument(f"writes.host {self.host!r} is unknown: use 'back' or 'through'")
        if not isinstance(self.batch_entries, int) or self.batch_entries < 1:
            raise InvalidArgument("writes.batch_entries must be a positive integer, "
                                  f"got {self.batch_entries!r}")
        if not 0.0 <= self.clean_ahead <= 1.0:
            raise InvalidArgument(f"writes.clean_ahead must lie in [0, 1], got {self.clean_ahead}")


POLICIES = {"lru": Lru, "flop": FlopAware}


@dataclass(frozen=True)
class PolicyConfig:
    eviction: str = "lru"
    # FLOP-aware: weight of FLOPs per byte against recency; 2 did best in benchmarks/policy_sim
    # on seeds it does not report (0.5 to 16 tried)
    alpha: float = 2.0
    tune_alpha: bool = False  # FLOP-aware: adjust alpha by what evictions turned out to cost
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    writes: WriteConfig = field(default_factory=WriteConfig)

    def __post_init__(self) -> None:
        if self.eviction not in POLICIES:
            raise InvalidArgument(f"eviction policy {self.eviction!r} is unknown: "
                                  f"use one of {sorted(POLICIES)}")
        if not 0.0 <= self.alpha < float("inf"):
            raise InvalidArgument(f"policy.alpha must be a finite number >= 0, got {self.alpha}")
        if self.tune_alpha and self.eviction != "flop":
            raise InvalidArgument("policy.tune_alpha needs eviction='flop': LRU has no alpha")


def make_policy(config: PolicyConfig | str) -> EvictionPolicy:
    """The eviction strategy a config (or just a strategy's name) asks for."""
    if isinstance(config, str):
        config = PolicyConfig(eviction=config)
    return FlopAware(config.alpha) if config.eviction == "flop" else Lru()
