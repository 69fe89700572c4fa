"""What the cache holds, as a stream of changes for routers (KV events).

The index reports every entry that enters or leaves a tier (`record`), under the engine's
lock, so recording only appends to a bounded queue: a slow or absent reader never slows
the cache, and a full queue drops changes and says so (`Taken.lost`: the reader then
tells routers to forget this cache and start over). A reader (the daemon's publisher)
`take`s the changes off that queue on its own thread and gets typed block events.

Routers want more than the index knows: the model a key belongs to, its parent key and
its page size, and, for routers that hash tokens themselves (llm-d), the tokens. A store
`announce`s them before it runs, for the tenants whose events are streamed; only keys
announced are ever published, so a tenant whose stores are not announced never appears
(tenant isolation), and what is announced is remembered for a bounded number of keys
(the oldest forgotten first) and, with tokens, a smaller bound of pages. Keys are the
engine's (tenant-masked) keys: consistent within this cache, meaningless elsewhere.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from tiercache.hashing import key_list
from tiercache.keymap import KeyMap
from tiercache.results import Kind, Tier

MEDIUM = {Tier.DEVICE: "GPU", Tier.HOST: "CPU", Tier.DISK: "DISK"}
REMOTE_MEDIUM = "REMOTE"  # entries this cache wrote to the shared remote tier


class Change(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class Blocks:
    """One event: entries of one kind and model that entered or left one medium. Stored
    keys run down one chain: each key's parent is the key before it."""

    change: Change
    model: str
    kind: Kind
    medium: str
    keys: tuple[bytes, ...]
    parent: bytes | None = None  # of the first key; None for the first page of a prompt
    tokens: tuple[int, ...] = ()  # of every page in `keys`, or none when not all known
    page_tokens: int = 0


@dataclass(frozen=True)
class Taken:
    events: list[Blocks]
    lost: bool  # changes were dropped since the last take: routers must start over


@dataclass(frozen=True)
class EventLogConfig:
    max_pending_keys: int = 1 << 20  # keys waiting for the reader; more are dropped
    lineage_keys: int = 1 << 20  # announced keys remembered (about 60 bytes each)
    token_pages: int = 1 << 16  # pages whose tokens are remembered


class _Lineage:
    """Announced keys, oldest forgotten first: parent, model and page size of each."""

    def __init__(self, capacity: int) -> None:
        self.map = KeyMap()
        self.keys = np.zeros((capacity, 2), np.uint64)
        self.used = np.zeros(capacity, bool)
        self.parent = np.zeros((capacity, 2), np.uint64)
        self.has_parent = np.zeros(capacity, bool)
        self.model = np.zeros(capacity, np.int32)
        self.page_tokens = np.zeros(capacity, np.int32)
        self.next = 0  # the ring position the next new key takes

    def add(self, keys: np.ndarray, model: int, page_tokens: int) -> None:
        new = np.flatnonzero(self.map.lookup(keys) < 0)
        for i in new.tolist():  # a prompt's new pages: usually few, always under a lock
            row = self.next
            self.next = (row + 1) % len(self.keys)
            if self.used[row]:
                self.map.delete(self.keys[row:row + 1])
            self.keys[row], self.used[row] = keys[i], True
            self.has_parent[row] = i > 0
            self.parent[row] = keys[i - 1] if i > 0 else 0
            self.model[row], self.page_tokens[row] = model, page_tokens
            self.map.insert(keys[i:i + 1], np.array([row]))


class EventLog:
    def __init__(self, config: EventLogConfig = EventLogConfig()) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._pending: deque[tuple[Change, np.ndarray, str, np.ndarray]] = deque()
        self._pending_keys = 0
        self._lost = False
        self.dropped = 0  # changes dropped for a full queue, since the start
        self.batches = 0  # batches the reader published (it counts them here)
        self._lineage = _Lineage(config.lineage_keys)
        self._models: dict[str, int] = {}
        self._tokens: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()

    def announce(self, model: str, keys: np.ndarray, page_tokens: int,
                 tokens: np.ndarray | None = None) -> None:
        """A store of the chain `keys` (engine keys, pages 1..n) is coming: publish its
        entries as `model`'s, with `tokens` (n * page_tokens of them) if given."""
        if not len(keys):
            return
        with self._lock:
            model_id = self._models.setdefault(model, len(self._models))
            self._lineage.add(keys, model_id, page_tokens)
            if tokens is not None:
                whole = min(len(tokens) // page_tokens, len(keys)) * page_tokens
                pages = np.asarray(tokens, np.int64)[:whole].reshape(-1, page_tokens)
                for key, page in zip(key_list(keys[:len(pages)]), pages.tolist()):
                    self._tokens[key] = tuple(page)
                    self._tokens.move_to_end(key)
                while len(self._tokens) > self.config.token_pages:
                    self._tokens.popitem(last=False)

    def record(self, change: Change, kinds: np.ndarray, medium: str, keys: np.ndarray) -> None:
        """Entries entered (STORED) or left (REMOVED) a medium. Called under the engine
        lock: copies and appends, nothing else."""
        if not len(keys):
            return
        with self._lock:
            if self._pending_keys + len(keys) > self.config.max_pending_keys:
                self._lost = True
                self.dropped += len(keys)
                return
            self._pending.append((change, np.array(kinds, np.uint8), medium, np.array(keys, np.uint64)))
            self._pending_keys += len(keys)

    def record_tier(self, change: Change, kinds: np.ndarray, tier: Tier, keys: np.ndarray) -> None:
        self.record(change, kinds, MEDIUM[tier], keys)

    def models(self) -> list[str]:
        """Every model announced so far."""
        with self._lock:
            return list(self._models)

    def take(self) -> Taken:
        """Everything recorded since the last take, as events, in order."""
        with self._lock:
            pending, self._pending, self._pending_keys = self._pending, deque(), 0
            lost, self._lost = self._lost, False
            events: list[Blocks] = []
            for change, kinds, medium, keys in pending:
                for kind in np.unique(kinds).tolist():
                    events += self._events(change, Kind(kind), medium, keys[kinds == kind])
        return Taken(events, lost)

    def _events(self, change: Change, kind: Kind, medium: str, keys: np.ndarray) -> list[Blocks]:
        lineage = self._lineage
        rows = lineage.map.lookup(keys)
        known = rows >= 0  # keys never announced (another tenant's) are left out
        keys, rows = keys[known], rows[known]
        models = {v: k for k, v in self._models.items()}
        events = []
        for start, end in _runs(keys, rows, lineage) if change is Change.STORED else \
                _by_model(rows, lineage):
            run, first = key_list(keys[start:end]), int(rows[start])
            model = models[int(lineage.model[first])]
            if change is Change.REMOVED:
                events.append(Blocks(change, model, kind, medium, tuple(run)))
                continue
            parent = lineage.parent[first].tobytes() if lineage.has_parent[first] else None
            pages = [self._tokens.get(key) for key in run]
            tokens = () if any(p is None for p in pages) else tuple(t for p in pages for t in p)
            events.append(Blocks(change, model, kind, medium, tuple(run), parent, tokens,
                                 int(lineage.page_tokens[first])))
        return events


def _runs(keys: np.ndarray, rows: np.ndarray, lineage: _Lineage) -> list[tuple[int, int]]:
    """[start, end) runs of keys where each key's parent is the key before it, of one
    model and page size."""
    if not len(keys):
        return []
    chained = ((lineage.parent[rows[1:]] == keys[:-1]).all(axis=1) & lineage.has_parent[rows[1:]]
               & (lineage.model[rows[1:]] == lineage.model[rows[:-1]])
               & (lineage.page_tokens[rows[1:]] == lineage.page_tokens[rows[:-1]]))
    breaks = [0, *(np.flatnonzero(~chained) + 1).tolist(), len(keys)]
    return list(zip(breaks[:-1], breaks[1:]))


def _by_model(rows: np.ndarray, lineage: _Lineage) -> list[tuple[int, int]]:
    """[start, end) runs of one model."""
    if not len(rows):
        return []
    models = lineage.model[rows]
    breaks = [0, *(np.flatnonzero(models[1:] != models[:-1]) + 1).tolist(), len(rows)]
    return list(zip(breaks[:-1], breaks[1:]))
