"""Eviction strategies: given the evictable entries of a tier, the order to evict them in.

Every touch of a page also touches its ancestors (a match walks through them, a store
names the whole chain), so ordering by last use with deeper entries first among equals
evicts leaves before their parents and keeps the cached prefixes matchable.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from tiercache.errors import InvalidArgument
from tiercache.index import Candidates


class EvictionPolicy(Protocol):
    name: str

    def order(self, candidates: Candidates) -> np.ndarray:
        """Positions into `candidates.rows`, first to evict first."""


class Lru:
    """Least recently used first; of entries used together, the deepest first."""

    name = "lru"

    def order(self, candidates: Candidates) -> np.ndarray:
        return np.lexsort((-candidates.depth.astype(np.int64), candidates.stamp))


POLICIES = {"lru": Lru}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidArgument(f"eviction policy {name!r} is unknown: use one of {sorted(POLICIES)}") from None
