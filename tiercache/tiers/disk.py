"""The disk tier: entries in LMDB, each with a checksum that is checked on every read.

The record format (two databases, `meta` for sealed headers and `data` for the bytes) is
tiers/lmdb_format.py. An entry's header and bytes are written in the same transaction, so an entry is either wholly there or not at all (invariant 1); the index
is rebuilt from `meta` alone. The map size is fixed when the environment opens and never
grows under load: a full map is reported as `DiskFull` and the engine evicts and retries.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import lmdb
import numpy as np

from tiercache import failpoints
from tiercache.errors import InvalidArgument, ResourceExhausted, Unavailable
from tiercache.hashing import PageKey
from tiercache.results import Kind
from tiercache.tiers import lmdb_format, recovery

GiB = 1 << 30
# LMDB copies every page it changes, deletes included, so a map that is full to the last
# page cannot even delete to make room: writes stop once live pages pass this share of
# the map, and the rest stays for the deletes of eviction.
_HIGH_WATER = 0.75
_DELETES_PER_COMMIT = 128
_RETRY_SECONDS = 5.0  # after the disk refused a write, writes wait this long before trying
log = logging.getLogger("tiercache.disk")

@dataclass(frozen=True)
class DiskConfig:
    path: str
    map_size: int = 16 * GiB
    budget_fraction: float = 0.8  # of map_size for entry bytes; the rest is LMDB's overhead
    sync: bool = True  # fsync on every commit: committed entries survive a power cut
    check_on_open: bool = True  # survey the environment in a child process first (recovery.py)

    def __post_init__(self) -> None:
        if self.map_size < 1 << 20:
            raise InvalidArgument(f"disk.map_size {self.map_size} is under 1 MiB")
        if not 0.0 < self.budget_fraction <= 0.95:
            raise InvalidArgument(f"disk.budget_fraction must lie in (0, 0.95], got {self.budget_fraction}")

    @property
    def budget_bytes(self) -> int:
        return int(self.map_size * self.budget_fraction)


@dataclass(frozen=True)
class DiskRecord:
    kind: Kind
    key: PageKey
    depth: int
    nbytes: int
    created_ns: int
    check: int = 0


class DiskFull(ResourceExhausted):
    """LMDB's map is full: evict and retry."""


class DiskError(Unavailable):
    """The disk under LMDB refused a write (no space left, an I/O error): the entries stay
    in memory, and the tier tries again only after `_RETRY_SECONDS`."""


class DiskReader:
    """Zero-copy reads inside one read transaction; views die with it."""

    def __init__(self, txn: lmdb.Transaction, tier: "DiskTier") -> None:
        self._txn = txn
        self._tier = tier

    def get(self, kind: Kind, key: PageKey) -> memoryview | None:
        """The entry's bytes, or None when missing or damaged (damage is counted)."""
        dkey = lmdb_format.db_key(kind, key)
        failpoints.hit("disk.read")
        try:
            header = self._txn.get(dkey, db=self._tier.meta_db)
            payload = self._txn.get(dkey, db=self._tier.data_db)
        except lmdb.Error:  # a damaged page on the way to the entry (MDB_CORRUPTED, ...)
            self._tier.checksum_failures += 1
            return None
        if header is None or payload is None:
            return None
        if lmdb_format.verify_entry(dkey, bytes(header), payload, deep=True) is None:
            self._tier.checksum_failures += 1
            return None
        return payload


class DiskTier:
    def __init__(self, config: DiskConfig, env: lmdb.Environment, owner: Any = None,
                 moved_aside: str | None = None) -> None:
        self.config = config
        self.env = env
        self.meta_db = env.open_db(lmdb_format.META_DB)
        self.data_db = env.open_db(lmdb_format.DATA_DB)
        self.used_bytes = 0
        self.checksum_failures = 0
        self.write_errors = 0  # writes the disk refused (ENOSPC, EIO): counted, logged once
        self.scanned = 0  # headers the last scan has read so far (its progress)
        self._failing_until = 0.0  # while the disk refuses writes: when to try again
        self.moved_aside = moved_aside  # where a damaged environment went at open, if one did
        self._owner = owner  # the lock that makes this process the environment's only user
        self._counting = threading.Lock()  # writes and deletes may run on different threads
        self._page_limit = int(config.map_size * _HIGH_WATER) // env.stat()["psize"]

    @classmethod
    def open(cls, config: DiskConfig) -> "DiskTier":
        """Open the environment, checked first and moved aside if damaged (recovery.py)."""
        os.makedirs(os.path.dirname(os.path.abspath(config.path)), exist_ok=True)
        owner = recovery.lock(config.path)
        try:
            # no writemap: with a writable map, a disk that runs out of space under the
            # sparse file answers a write with SIGBUS, which kills the daemon; written with
            # pwrite, it answers ENOSPC, an error that fails one batch
            env, aside = recovery.open_environment(
                config.path, config.check_on_open, map_size=config.map_size, max_dbs=2,
                sync=config.sync, metasync=config.sync, meminit=False, writemap=False,
                max_readers=512)
        except BaseException:
            owner.close()
            raise
        return cls(config, env, owner, aside)

    @property
    def budget_bytes(self) -> int:
        return self.config.budget_bytes

    def write(self, entries: Sequence[tuple[Kind, PageKey, int, object]],
              checks: Sequence[int] | None = None) -> None:
        """Write (kind, key, depth, payload) entries, with their checks (0 if not given), in
        one transaction: all or nothing."""
        if time.monotonic() < self._failing_until:
            self.write_errors += 1
            raise DiskError("the disk refused the last write: writes resume in a few seconds")
        created = time.time_ns()
        try:
            added = self._write(entries, [0] * len(entries) if checks is None else checks, created)
        except lmdb.MapFullError as error:
            raise DiskFull(f"LMDB map of {self.config.map_size} bytes is full") from error
        except lmdb.Error as error:  # the file system: out of space, an I/O error
            self.write_errors += 1
            if not self._failing_until:
                log.error("writing to the disk tier at %s failed (%s): entries stay in memory "
                          "only; retrying every %.0f s", self.config.path, error, _RETRY_SECONDS)
            self._failing_until = time.monotonic() + _RETRY_SECONDS
            raise DiskError(f"the disk tier at {self.config.path} refused a write: {error}") from None
        if self._failing_until:
            log.warning("the disk tier at %s takes writes again", self.config.path)
            self._failing_until = 0.0
        with self._counting:
            self.used_bytes += added
        failpoints.hit("disk.after_commit")

    def _write(self, entries: Sequence[tuple[Kind, PageKey, int, object]], checks: Sequence[int],
               created: int) -> int:
        added = 0
        with self.env.begin(write=True) as txn:
            for (kind, key, depth, payload), check in zip(entries, checks, strict=True):
                view = memoryview(payload).cast("B")  # type: ignore[arg-type]
                dkey = lmdb_format.db_key(kind, key)
                header = lmdb_format.header(kind, key, depth, view, check, created)
                if not txn.put(dkey, header, db=self.meta_db, overwrite=False):
                    continue  # already on disk
                txn.put(dkey, view, db=self.data_db)
                added += view.nbytes
            if self._pages(txn) > self._page_limit:
                raise DiskFull(f"LMDB map of {self.config.map_size} bytes is {_HIGH_WATER:.0%} "
                               "full: the rest is kept for deletes")
            failpoints.hit("disk.before_commit")  # an exception here aborts the transaction
        return added

    def _pages(self, txn: lmdb.Transaction) -> int:
        """Pages holding entries (as this transaction sees them; free pages not counted)."""
        return sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
                   for s in (txn.stat(self.meta_db), txn.stat(self.data_db)))

    def delete(self, entries: Sequence[tuple[Kind, PageKey]]) -> None:
        self._delete([lmdb_format.db_key(kind, key) for kind, key in entries])

    def _delete(self, dkeys: Sequence[bytes]) -> None:
        """Delete entries in small transactions: a delete copies every page it changes, so
        one transaction deleting many entries needs about as many free pages as they fill,
        which a nearly full map does not have. A transaction that runs out is redone in
        halves."""
        start, chunk = 0, _DELETES_PER_COMMIT
        while start < len(dkeys):
            try:
                removed = self._delete_some(dkeys[start:start + chunk])
            except lmdb.MapFullError as error:
                if chunk == 1:  # readers hold the free pages even one delete needs
                    raise DiskFull(f"LMDB map of {self.config.map_size} bytes is too full to "
                                   "delete in: retry when reads have finished") from error
                chunk //= 2
                continue
            start += chunk
            with self._counting:
                self.used_bytes -= removed

    def _delete_some(self, dkeys: Sequence[bytes]) -> int:
        removed = 0
        with self.env.begin(write=True) as txn:
            for dkey in dkeys:
                payload = txn.get(dkey, db=self.data_db)
                if payload is not None:
                    removed += len(payload)
                    txn.delete(dkey, db=self.data_db)
                txn.delete(dkey, db=self.meta_db)
        return removed

    @contextmanager
    def reader(self) -> Iterator[DiskReader]:
        with self.env.begin(buffers=True) as txn:
            yield DiskReader(txn, self)

    def headers(self) -> int:
        """How many entry headers the environment holds (sound or not), without reading them."""
        with self.env.begin() as txn:
            return int(txn.stat(self.meta_db)["entries"])

    def scan(self) -> list[DiskRecord]:
        """Every entry whose header is sound, oldest first; damaged headers are dropped."""
        records: list[DiskRecord] = []
        damaged: list[bytes] = []
        self.scanned = 0
        with self.env.begin() as txn:
            for dkey, header in txn.cursor(db=self.meta_db):
                self.scanned += 1
                kind = lmdb_format.kind_of(dkey)
                parsed = None if kind is None else lmdb_format.parse(kind, dkey[1:], header)
                if kind is None or parsed is None:
                    self.checksum_failures += 1
                    damaged.append(dkey)
                    continue
                depth, nbytes, _, created, check = parsed
                records.append(DiskRecord(kind, PageKey(dkey[1:]), depth, nbytes, created, check))
        if damaged:
            self._delete(damaged)
        self.used_bytes = sum(r.nbytes for r in records)
        records.sort(key=lambda r: r.created_ns)
        return records

    def close(self) -> None:
        self.env.close()
        if self._owner is not None:
            self._owner.close()


def as_array(view: memoryview) -> np.ndarray:
    """A read-only uint8 array over a disk view (no copy)."""
    return np.frombuffer(view, dtype=np.uint8)
