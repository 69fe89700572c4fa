"""The remote tier beside the engine: what a Match finds beyond the local hit, remote hits
brought into host slots for a Load, and stores written to the shared store behind them.

The remote tier is not in the index: the store is shared and evicts on its own, so the
index could not keep it true. Instead a Match whose local hit stops short asks the store
about the pages and checkpoints beyond it, in one pipelined round trip per node within
the lookup budget, and reports what it adds as `Tier.REMOTE` (`extend`). A Load first
fetches those entries straight into host slots that nobody can see yet, checks them,
and publishes them in the host tier (invariant 1); the Load then goes on as a host hit
and reports what it delivered, so it never promises what it could not fetch
(invariant 2). Stores are written to the store in the background, in batches, on a
thread of their own (`write_soon`): an entry is read from its host slot while pinned
(invariant 3); one evicted before the writer reached it is skipped and counted.
Every failure of the store is a miss or a skipped write (tiers/remote).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from tiercache.background import Runner
from tiercache.errors import InvalidArgument
from tiercache.books import Books
from tiercache.events import REMOTE_MEDIUM, Change, EventLog
from tiercache.layout import Layout
from tiercache.metrics import Traffic
from tiercache.results import Kind, Match, StopReason, Tier
from tiercache.tiers.remote.entry import EntryRef, Meta
from tiercache.tiers.remote.store import Entry, RemoteConfig, RemoteStore, Wanted


@dataclass(frozen=True)
class RemoteTierConfig:
    store: RemoteConfig
    lookup_pages: int = 4096  # pages beyond the local hit a Match asks the store about
    queue_keys: int = 1 << 16  # entries waiting to be written; more are skipped, counted
    batch_entries: int = 128  # entries per write batch (the store bounds its bytes too)
    # "through": stores are written behind the reply; "evict": entries are written when
    # they leave this node (evicted from the disk tier, or from the host without a disk)
    writes: str = "through"

    def __post_init__(self) -> None:
        if self.writes not in ("through", "evict"):
            raise InvalidArgument(f"remote writes {self.writes!r}: choose through or evict")


@dataclass(frozen=True)
class Extension:
    """A match that reaches into the remote tier, and the entries a Load must fetch."""

    match: Match
    pages: list[tuple[int, Meta]]  # (position in the prompt, metadata) of remote pages
    checkpoint: tuple[int, Meta] | None  # of the remote checkpoint the match ends on


def remote_namespace(secret: bytes) -> str:
    """The remote namespace of daemons that share `secret`: they mask keys alike, so they
    can share entries; daemons with other secrets never meet theirs."""
    return hmac.new(secret, b"tiercache/remote-namespace/v1", hashlib.sha256).hexdigest()[:16]


@dataclass(frozen=True)
class Local:
    """What the local tiers hold of a prompt (taken under the engine lock)."""

    hit: Match
    pages: np.ndarray  # bool per key
    page_tiers: np.ndarray  # best local tier per key (0 where absent)
    checkpoints: np.ndarray  # bool per key
    checkpoint_tiers: np.ndarray


class RemoteTier:
    def __init__(self, config: RemoteTierConfig, store: RemoteStore, books: Books,
                 traffic: Traffic) -> None:
        self.config = config
        self.store = store
        self.books = books
        self.traffic = traffic
        self._counting = threading.Lock()
        self.events: EventLog | None = None
        self.counters = dict.fromkeys(["remote_matched_pages", "remote_matched_checkpoints",
                                       "remote_fetched", "remote_fetch_failed",
                                       "remote_written", "remote_write_skipped"], 0)
        self._queue: deque[tuple[Kind, np.ndarray]] = deque()
        self._queued = 0
        self._queue_lock = threading.Lock()
        self.writer = Runner(self._step, "tiercache-remote-writer")

    # -- match ----------------------------------------------------------------------------
    def local(self, layout: Layout, keys: np.ndarray, checks: np.ndarray | None,
              hit: Match) -> Local:
        """What the local tiers hold of a prompt, read from the books at once."""
        pages, page_tiers, marks, mark_tiers = self.books.held(
            keys, layout.page_bytes, layout.checkpoint_bytes, checks)
        return Local(hit, pages, page_tiers, marks, mark_tiers)

    def extend(self, layout: Layout, keys: np.ndarray, checks: np.ndarray | None,
               local: Local) -> Extension | None:
        """The match of `keys` over the local tiers and the store; None if the store adds
        nothing to the local hit. Call without the engine lock."""
        start, limit = local.hit.pages, min(len(keys), local.hit.pages + self.config.lookup_pages)
        if start >= limit:
            return None
        span = np.arange(start, limit)
        ask_pages = span[~local.pages[span]] if layout.needs_pages else span[:0]
        ask_marks = span[~local.checkpoints[span]] if layout.needs_checkpoint else span[:0]
        refs = [EntryRef(kind, keys[i].tobytes()) for kind, where in
                ((Kind.PAGE, ask_pages), (Kind.CHECKPOINT, ask_marks)) for i in where.tolist()]
        metas = self.store.exists(refs).metas if refs else ()
        found_pages = self._usable(metas[:len(ask_pages)], ask_pages, layout.page_bytes, checks)
        found_marks = self._usable(metas[len(ask_pages):], ask_marks, layout.checkpoint_bytes, checks)
        pages = local.pages[:limit].copy()
        pages[list(found_pages)] = True
        marks = local.checkpoints[:limit].copy()
        marks[list(found_marks)] = True
        walked = int(np.argmin(pages)) if not pages.all() else limit
        n = walked
        if layout.needs_checkpoint:
            ends = np.flatnonzero(marks[:walked])
            n = int(ends[-1]) + 1 if len(ends) else 0
        if n <= local.hit.pages:
            return None
        remote_pages = [(i, found_pages[i]) for i in range(n) if i in found_pages and not local.pages[i]]
        mark = (n - 1, found_marks[n - 1]) if layout.needs_checkpoint and not local.checkpoints[n - 1] else None
        codes = np.where(local.pages[:n], local.page_tiers[:n], int(Tier.REMOTE)).astype(np.uint8)
        stop = (StopReason.END_OF_PROMPT if n == len(keys) else
                StopReason.MISSING_PAGE if n == walked else StopReason.NO_CHECKPOINT)
        checkpoint_tier = None
        if layout.needs_checkpoint:
            checkpoint_tier = Tier.REMOTE if mark else Tier(int(local.checkpoint_tiers[n - 1]))
        match = Match(n, n * layout.page_tokens, len(keys),
                      codes.tobytes() if layout.needs_pages else b"", checkpoint_tier, stop,
                      walked if layout.needs_pages else n)
        return Extension(match, remote_pages, mark)

    @staticmethod
    def _usable(metas, where: np.ndarray, nbytes: int, checks: np.ndarray | None) -> dict[int, Meta]:
        """Positions whose remote entry has the caller's size and check."""
        found = {}
        for position, meta in zip(where.tolist(), metas):
            if meta is None or meta.nbytes != nbytes:
                continue
            if checks is not None and meta.check and meta.check != int(checks[position]):
                continue
            found[position] = meta
        return found

    # -- load -----------------------------------------------------------------------------
    def fetch(self, extension: Extension, keys: np.ndarray, layout: Layout) -> np.ndarray:
        """Bring an extension's remote entries into host slots and publish them there,
        pinned; returns their rows (the caller unpins them after its load)."""
        groups = [(Kind.PAGE, layout.page_bytes, extension.pages)]
        if extension.checkpoint is not None:
            groups.append((Kind.CHECKPOINT, layout.checkpoint_bytes, [extension.checkpoint]))
        pinned = []
        for kind, nbytes, wanted in groups:
            if wanted:
                pinned.append(self._fetch(kind, nbytes, wanted, keys))
        return np.concatenate(pinned) if pinned else np.empty(0, np.int64)

    def _fetch(self, kind: Kind, nbytes: int, wanted: list[tuple[int, Meta]],
               keys: np.ndarray) -> np.ndarray:
        slots = self.books.reserve_clean(nbytes, len(wanted))  # shallow first: worth most
        wanted = wanted[:len(slots)]
        pool = self.books.host.pool(nbytes)
        views = [memoryview(pool.view(s).numpy()) for s in slots]
        start = time.perf_counter()
        got = self.store.get([Wanted(EntryRef(kind, keys[i].tobytes()), nbytes, meta.check)
                              for i, meta in wanted], views).ok
        self.traffic.record("remote", "host", nbytes * sum(got), time.perf_counter() - start)
        positions = np.array([i for i, _ in wanted], np.int64)
        ok = np.array(got, bool)
        checks = np.array([meta.check for _, meta in wanted], np.uint64)
        published = self.books.adopt(kind, keys[positions[ok]], positions[ok] + 1, nbytes,
                                     np.asarray(slots, np.int64), ok, checks[ok])
        with self._counting:
            self.counters["remote_fetched"] += len(published)
            self.counters["remote_fetch_failed"] += int((~ok).sum())
        return published

    # -- writes ---------------------------------------------------------------------------
    def write_soon(self, kind: Kind, keys: np.ndarray) -> None:
        """Write these entries to the store in the background (those still cached when the
        writer reaches them). Never waits: past `queue_keys`, entries are skipped."""
        if not len(keys):
            return
        with self._queue_lock:
            if self._queued + len(keys) > self.config.queue_keys:
                with self._counting:
                    self.counters["remote_write_skipped"] += len(keys)
                return
            self._queue.append((kind, np.array(keys, np.uint64)))
            self._queued += len(keys)
        self.writer.kick()

    def _step(self) -> bool:
        """Write one batch; False when the queue is empty."""
        with self._queue_lock:
            if not self._queue:
                return False
            kind, keys = self._queue.popleft()
            if len(keys) > self.config.batch_entries:
                self._queue.appendleft((kind, keys[self.config.batch_entries:]))
                keys = keys[:self.config.batch_entries]
            self._queued -= len(keys)
        rows, held = self.books.pin_in_host(kind, keys)
        with self._counting:
            self.counters["remote_write_skipped"] += len(keys) - len(rows)
        try:
            self._put([Entry(EntryRef(kind, key), depth, memoryview(view.numpy()), check)
                       for key, depth, view, check in held], "host")
        finally:
            self.books.unpin(rows)
        return True

    def hand_off(self, entries: list) -> None:
        """Write entries that are leaving this node now ((kind, key, depth, bytes, check),
        the bytes valid during the call): the write-on-eviction policy."""
        source = "host" if self.books.disk is None else "disk"
        self._put([Entry(EntryRef(kind, key), depth, memoryview(data), check)
                   for kind, key, depth, data, check in entries], source)

    def _put(self, entries: list[Entry], source: str) -> None:
        if not entries:
            return
        start = time.perf_counter()
        written = self.store.put(entries)
        self.traffic.record(source, "remote", written.nbytes, time.perf_counter() - start)
        with self._counting:
            self.counters["remote_written"] += written.stored
        landed = [e for e, ok in zip(entries, written.landed) if ok]
        if self.events is not None and landed:
            self.events.record(Change.STORED, np.array([int(e.ref.kind) for e in landed]),
                               REMOTE_MEDIUM,
                               np.frombuffer(b"".join(e.ref.key for e in landed), "<u8").reshape(-1, 2))

    def start(self) -> None:
        self.writer.start()

    def drain(self) -> None:
        self.writer.drain()

    def close(self) -> None:
        """Give up the writes still queued (counted as skipped: a remote copy is best
        effort, and a slow cluster must not hold up a shutdown), finish the batch in
        flight (within the store's put budget), then close."""
        with self._queue_lock, self._counting:
            self.counters["remote_write_skipped"] += self._queued
            self._queue.clear()
            self._queued = 0
        self.writer.stop()
        self.store.close()

    def stats(self) -> dict[str, int]:
        store = self.store.stats()
        with self._counting:
            counters = dict(self.counters)
        return {**counters, **store,
                "remote_lookup_misses": store["remote_lookups"] - store["remote_lookup_hits"],
                "remote_writes_skipped": store["remote_put_skipped"] + counters["remote_write_skipped"]}
