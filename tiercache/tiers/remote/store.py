"""The remote tier's contract: a small interface every shared store implements, its one
frozen config, and what its calls return.

A remote store is shared by the daemons of many nodes and can lose any key at any moment
(its own eviction, a node going down), so its calls never raise for what the store does:
every entry comes back found or not, written or not, and the reasons are counted
(`RemoteStats`). Callers give each call a time budget; what the store has not answered
within it is a miss or a skipped write. One adapter per URL scheme implements it
(adapters.py picks one by URL); redis-py's Redis Cluster client is the first
(redis_cluster.py).
"""

from __future__ import annotations

import bisect
import enum
import threading
from dataclasses import dataclass, field
from typing import Protocol, Sequence
from urllib.parse import urlsplit

from tiercache.errors import InvalidArgument
from tiercache.metrics import BUCKETS
from tiercache.results import Kind
from tiercache.tiers.remote.entry import MAX_PART_BYTES, EntryRef, Meta, check_namespace

MiB = 1 << 20
SCHEMES = ("redis-cluster",)


@dataclass(frozen=True)
class RemoteConfig:
    url: str  # redis-cluster://host:port[,host:port...]: one reachable node is enough
    namespace: str = "default"  # part of every key: daemons share entries only within one
    prefix: str = "tc"
    part_bytes: int = 16 * MiB  # entries above this are split; every daemon must agree
    lookup_seconds: float = 0.05  # budget of a match's lookup (one round trip per node)
    get_seconds: float = 2.0  # budget of a load's fetch
    put_seconds: float = 5.0  # budget of one batch of writes (off the request path)
    connect_seconds: float = 0.25  # to open a connection to a node
    retry_seconds: float = 1.0  # a node that failed is skipped this long, then tried again
    threads: int = 8  # node pipelines in flight at once

    def __post_init__(self) -> None:
        nodes(self.url)  # raises for a malformed URL
        check_namespace(self.namespace)
        check_namespace(self.prefix)
        if not 0 < self.part_bytes <= MAX_PART_BYTES:
            raise InvalidArgument(f"remote part_bytes must lie in (0, {MAX_PART_BYTES}], got "
                                  f"{self.part_bytes}: Redis refuses larger values")
        for name in ("lookup_seconds", "get_seconds", "put_seconds", "connect_seconds",
                     "retry_seconds"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"remote {name} must be positive, got {getattr(self, name)}")
        if self.threads < 1:
            raise InvalidArgument(f"remote threads must be at least 1, got {self.threads}")


def nodes(url: str) -> list[tuple[str, int]]:
    """redis-cluster://a:7000,b:7001 -> [("a", 7000), ("b", 7001)]."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise InvalidArgument(f"remote URL {url!r}: the scheme must be one of {SCHEMES}, e.g. "
                              "redis-cluster://10.0.0.5:7000")
    if "@" in parts.netloc:
        raise InvalidArgument("remote URL: write no user or password in it (the daemon logs its "
                              "settings, and Redis AUTH is not supported yet)")
    found = []
    for address in parts.netloc.split(","):
        host, colon, port = address.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"remote URL {url!r}: {address!r} is not host:port")
        found.append((host.strip("[]"), int(port)))
    return found


class Failure(enum.Enum):
    """Why a remote call left an entry out: each is counted, and logged once an incident."""

    CONNECTION = "connection"  # the node cannot be reached (down, refused, reset)
    NODE_DOWN = "node_down"  # skipped: the node failed moments ago and is left alone a while
    TIMEOUT = "timeout"  # no answer within the call's budget
    MOVED = "moved"  # the slot lives on another node now (the map is refreshed)
    ASK = "ask"  # the slot is migrating
    OOM = "oom"  # Redis is full and may not evict (maxmemory-policy noeviction)
    CLUSTER_DOWN = "cluster_down"  # CLUSTERDOWN, TRYAGAIN, MASTERDOWN
    OTHER = "other"


class Damage(enum.Enum):
    """Why an entry whose metadata was found could not be served."""

    META = "meta"  # the record is damaged, or of another format or part size
    MISMATCH = "mismatch"  # another size or check than the caller's: left alone, not served
    PART_MISSING = "part_missing"  # the store evicted a part
    PART_SIZE = "part_size"
    CHECKSUM = "checksum"


@dataclass(frozen=True)
class Wanted:
    """An entry a load asks for: its name, its size, and the check it must carry."""

    ref: EntryRef
    nbytes: int
    check: int = 0  # 0: no check to compare


@dataclass(frozen=True)
class Entry:
    """An entry to write."""

    ref: EntryRef
    depth: int
    payload: memoryview
    check: int = 0


@dataclass(frozen=True)
class Found:
    """What `exists` saw: the sound metadata of each entry asked about, or None."""

    metas: tuple[Meta | None, ...]

    @property
    def present(self) -> list[bool]:
        return [m is not None for m in self.metas]


@dataclass(frozen=True)
class Fetched:
    """Which entries `get` copied whole and verified into their targets; a target of an
    entry not fetched holds undefined bytes."""

    ok: tuple[bool, ...]
    nbytes: int  # bytes of the entries fetched


@dataclass(frozen=True)
class Written:
    stored: int  # entries written now
    present: int  # entries already in the store (not written again)
    skipped: int  # entries not written: a failure, or no answer within the budget
    nbytes: int  # bytes written
    landed: tuple[bool, ...] = ()  # per entry: in the store now (written or present)

    def __add__(self, other: "Written") -> "Written":
        return Written(self.stored + other.stored, self.present + other.present,
                       self.skipped + other.skipped, self.nbytes + other.nbytes,
                       self.landed + other.landed)


class RemoteStore(Protocol):
    def exists(self, refs: Sequence[EntryRef], seconds: float | None = None) -> Found:
        """Look up entries' metadata, in one pipelined round trip per node."""

    def get(self, wanted: Sequence[Wanted], targets: Sequence[memoryview],
            seconds: float | None = None) -> Fetched:
        """Fetch entries into `targets` (one writable buffer of exactly `nbytes` each)."""

    def put(self, entries: Sequence[Entry], seconds: float | None = None) -> Written:
        """Write entries that are not in the store yet: parts first, metadata last."""

    def delete(self, refs: Sequence[EntryRef], seconds: float | None = None) -> int:
        """Remove entries (metadata first); returns how many were there."""

    def stats(self) -> dict[str, int]:
        """Counters since the store opened (RemoteStats.snapshot)."""

    def latency(self) -> dict[str, tuple[list[int], int, float]]:
        """Per operation: (histogram bucket counts over metrics.BUCKETS, +Inf last;
        calls; seconds)."""

    def close(self) -> None:
        """Close connections; the store is unusable afterwards."""


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: int = 0
    seconds: float = 0.0


OPERATIONS = ("exists", "get", "put", "delete")


class RemoteStats:
    """Counters of one remote store, thread-safe: calls run on several threads."""

    COUNTERS = ("lookups", "lookup_hits", "gets", "get_hits", "get_misses", "bytes_read",
                "puts", "put_stored", "put_present", "put_skipped", "bytes_written", "deletes",
                *(f"errors_{f.value}" for f in Failure), *(f"damaged_{d.value}" for d in Damage))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.COUNTERS, 0)
        self._latency = {op: _Histogram() for op in OPERATIONS}

    def add(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] += n

    def timed(self, operation: str, seconds: float) -> None:
        with self._lock:
            hist = self._latency[operation]
            hist.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
            hist.total += 1
            hist.seconds += seconds

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            flat: dict[str, int] = {f"remote_{k}": v for k, v in self._counts.items()}
            for op, hist in self._latency.items():
                flat[f"remote_{op}_calls"] = hist.total
                flat[f"remote_{op}_us"] = int(hist.seconds * 1e6)  # counters are integers
            return flat

    def latency(self) -> dict[str, tuple[list[int], int, float]]:
        """Per operation: (bucket counts, the last one +Inf; calls; seconds), for metrics."""
        with self._lock:
            return {op: (list(h.counts), h.total, h.seconds) for op, h in self._latency.items()}


def page_refs(kind: Kind, keys: Sequence[bytes]) -> list[EntryRef]:
    return [EntryRef(kind, bytes(key)) for key in keys]
