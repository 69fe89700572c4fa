"""Tuning the FLOP-aware policy's alpha from recent history, by regret.

After LeCaR (Vietri et al., HotStorage 2018), with recency and FLOPs per byte as the two
experts. A host victim on which the two disagree is remembered (a bounded ring of keys,
newest kept) with the one that condemned it: "recency" when it was among the older half of
the candidates but the more valuable half (old, but worth much), "value" when among the
newer half but the cheaper half (recent, but cheap). Victims both would have evicted
teach nothing and are not kept. When a
remembered entry is stored again, it was needed after all and its condemner was wrong:
alpha grows by up to a factor e^rate when recency regrets dominate the store, shrinks
when value regrets do. The work happens at eviction and at store time, never in a match.
"""

from __future__ import annotations

import math

import numpy as np

from tiercache.index import Candidates
from tiercache.results import Kind
from tiercache.keymap import KeyMap

_RECENCY, _VALUE = 1, 2  # blame codes; 0 marks a forgotten ring slot
ALPHA_RANGE = (0.01, 100.0)


def _ranks(column: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Percentile rank in [0, 1] of column[at] within column; ties rank at their middle."""
    ordered = np.sort(column)
    below = np.searchsorted(ordered, column[at], side="left")
    upto = np.searchsorted(ordered, column[at], side="right")
    return (below + upto) / (2 * max(1, len(column)))


class AlphaTuner:
    def __init__(self, alpha: float, capacity: int = 1 << 16, rate: float = 0.1) -> None:
        self.alpha = min(max(alpha, ALPHA_RANGE[0]), ALPHA_RANGE[1])
        self.rate = rate
        self._maps = (KeyMap(), KeyMap())  # by Kind: key -> ring slot
        self._keys = np.zeros((capacity, 2), np.uint64)
        self._kinds = np.zeros(capacity, np.uint8)
        self._blame = np.zeros(capacity, np.uint8)
        self._head = 0

    def evicted(self, candidates: Candidates, victims: np.ndarray, keys: np.ndarray) -> None:
        """Remember victims (positions into `candidates`, with their keys) and who chose them."""
        recent = _ranks(candidates.stamp, victims)
        worth = _ranks(candidates.value, victims)
        blame = np.where(recent < 0.5, _RECENCY, _VALUE).astype(np.uint8)
        disputed = np.flatnonzero((recent < 0.5) != (worth < 0.5))
        victims, keys, blame = victims[disputed], keys[disputed], blame[disputed]
        kinds = candidates.kind[victims]
        take = slice(max(0, len(victims) - len(self._keys)), None)  # newest win
        for kind in Kind:
            mine = np.flatnonzero(kinds[take] == kind)
            self._forget(kind, keys[take][mine])
            self._remember(kind, keys[take][mine], blame[take][mine])

    def _forget(self, kind: Kind, keys: np.ndarray) -> None:
        slots = self._maps[kind].lookup(keys)
        slots = slots[slots >= 0]
        if len(slots):
            self._maps[kind].delete(self._keys[slots])
            self._blame[slots] = 0

    def _remember(self, kind: Kind, keys: np.ndarray, blame: np.ndarray) -> None:
        if not len(keys):
            return
        slots = (self._head + np.arange(len(keys))) % len(self._keys)
        self._head = int(slots[-1] + 1) % len(self._keys)
        for old_kind in Kind:  # the ring wraps: forget what these slots remembered
            old = slots[(self._blame[slots] != 0) & (self._kinds[slots] == old_kind)]
            if len(old):
                self._maps[old_kind].delete(self._keys[old])
        self._keys[slots], self._kinds[slots], self._blame[slots] = keys, kind, blame
        self._maps[kind].insert(keys, slots)

    def returned(self, kind: Kind, keys: np.ndarray) -> int:
        """Keys being stored anew: settle the regrets among them (moving alpha); returns
        how many there were."""
        slots = self._maps[kind].lookup(keys) if len(keys) else np.empty(0, np.int64)
        slots = slots[slots >= 0]
        if not len(slots):
            return 0
        recency = int(np.count_nonzero(self._blame[slots] == _RECENCY))
        value = len(slots) - recency
        self._maps[kind].delete(self._keys[slots])
        self._blame[slots] = 0
        step = math.exp(self.rate * (recency - value) / len(slots))
        self.alpha = min(max(self.alpha * step, ALPHA_RANGE[0]), ALPHA_RANGE[1])
        return len(slots)
