"""Opening the disk tier's LMDB environment safely, whatever state it was left in.

LMDB trusts its file: a damaged page can make it return an error, or read past the end
of its map and take the process down with it. So before the daemon opens an environment,
a child process walks it (`survey`): both databases, every header, every value's size. If
the child fails, crashes or hangs, or the environment will not open, the directory is
moved aside as `<path>.damaged-<time>` with an ERROR in the log, and the tier starts
empty: the cache rebuilds itself, the evidence stays for a look.

One process owns an environment (a lock file beside it), so the reader table in lock.mdb,
which a crash can leave stale or a disk can damage, is always rebuilt at open.
Damage inside single entries is not this module's job: every value carries a checksum
that each read checks (disk.py).

    python -m tiercache.tiers.recovery PATH [--deep]     # survey, as the child runs it
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, TextIO

import lmdb

from tiercache.errors import FailedPrecondition
from tiercache.tiers import lmdb_format

log = logging.getLogger("tiercache.disk")

Visit = Callable[[int, bytes, memoryview], None]  # kind, key, payload of each sound entry


@dataclass(frozen=True)
class Survey:
    entries: int  # sound headers whose value is there with the size they say
    damaged: int  # headers unreadable, values missing, sizes disagreeing, checksums wrong
    bytes: int


def survey(path: str, deep: bool = False, visit: Visit | None = None) -> Survey:
    """Walk an environment read-only; with `deep`, also check every value's checksum (and
    hand each sound entry to `visit`). Raises lmdb.Error where LMDB finds it broken."""
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=2, subdir=True)
    entries = damaged = total = 0
    try:
        meta = env.open_db(lmdb_format.META_DB, create=False)
        data = env.open_db(lmdb_format.DATA_DB, create=False)
        with env.begin(buffers=True) as txn:
            for dkey, header in txn.cursor(db=meta):
                dkey = bytes(dkey)
                payload = txn.get(dkey, db=data)  # a view: its size, no read of its pages
                nbytes = lmdb_format.verify_entry(dkey, bytes(header), payload, deep)
                if nbytes is None:
                    damaged += 1
                    continue
                entries, total = entries + 1, total + nbytes
                if visit is not None and payload is not None:
                    visit(dkey[0], dkey[1:], payload)
    finally:
        env.close()
    return Survey(entries, damaged, total)


def probe(path: str, timeout: float = 600.0) -> str | None:
    """Survey `path` in a child process; None if it is sound, else what went wrong."""
    if not os.path.exists(os.path.join(path, "data.mdb")):
        return None  # nothing there yet: LMDB creates it
    command = [sys.executable, "-m", "tiercache.tiers.recovery", path]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"checking it took over {timeout:.0f} s"
    if done.returncode < 0:
        return f"checking it crashed the checker (signal {-done.returncode})"
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["the checker failed"])[-1]
    return None


# LMDB keeps two meta pages (pages 0 and 1) and commits to them in turn; each names a
# whole snapshot, and the older snapshot's pages stay untouched until the next commit. One
# damaged meta page makes LMDB refuse the file (MDB_INVALID), though the other still
# names a sound snapshot: `repair_meta` copies the sound one over the damaged one.
_META_FLAG = 0x08  # P_META in the page header's mp_flags (bytes 10-11)
_META_MAGIC = 0xBEEFC0DE  # mm_magic, right after the 16-byte page header
_META_VERSION = 1
_PSIZE_AT = 40  # the page size: mm_dbs[FREE_DBI].md_pad
_HEADER_BYTES = 64


def _sound_meta(page: bytes) -> bool:
    if len(page) < _HEADER_BYTES:
        return False
    flags, = struct.unpack_from("<H", page, 10)
    magic, version = struct.unpack_from("<II", page, 16)
    return bool(flags & _META_FLAG) and magic == _META_MAGIC and version == _META_VERSION


def repair_meta(path: str) -> bool:
    """If exactly one of the two meta pages of the environment at `path` is damaged, copy
    the other over it (the last commit may be lost, nothing older); True if it did."""
    data = os.path.join(path, "data.mdb")
    try:
        with open(data, "r+b") as f:
            first = f.read(_HEADER_BYTES)
            psize = struct.unpack_from("<I", first, _PSIZE_AT)[0] if _sound_meta(first) else 0
            if not psize:  # page 0 is the damaged one: page 1 says the size
                for guess in (4096, 8192, 16384, 65536):
                    f.seek(guess)
                    if _sound_meta(f.read(_HEADER_BYTES)):
                        psize = guess
                        break
            if not psize or psize & (psize - 1):
                return False
            f.seek(0)
            pages = [f.read(psize), f.read(psize)]
            sound = [_sound_meta(page) for page in pages]
            if sound.count(True) != 1:
                return False
            good = sound.index(True)
            copy = bytearray(pages[good])
            struct.pack_into("<Q", copy, 0, 1 - good)  # mp_pgno: the page's own number
            f.seek((1 - good) * psize)
            f.write(copy)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        return False
    log.warning("meta page %d of the LMDB environment at %s was damaged: restored it from meta "
                "page %d (the last commit may be lost; every entry is still checked by its "
                "checksum)", 1 - good, path, good)
    return True


def move_aside(path: str, why: str) -> str:
    """Rename a damaged environment out of the way, loudly; returns its new name."""
    aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    os.rename(path, aside)
    log.error("the LMDB environment at %s is damaged (%s): moved it to %s and started an "
              "empty disk tier. Cached entries are lost, not served; delete %s once looked at.",
              path, why, aside, aside)
    return aside


def lock(path: str) -> TextIO:
    """Take the environment for this process; held until the returned file is closed."""
    holder = open(f"{path}.lock", "a")
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder.close()
        raise FailedPrecondition(f"another process uses the disk tier at {path}: give each "
                                 "daemon a data directory of its own") from None
    return holder


def open_environment(path: str, check: bool, **options: object
                     ) -> tuple[lmdb.Environment, str | None]:
    """Open (creating if needed) the environment at `path` with `options`, moving it aside
    first if the check finds it broken or it will not open. Returns the environment and
    where a damaged one went. The caller holds `lock(path)`."""
    why = probe(path) if check else None
    if why is not None and repair_meta(path):
        why = probe(path)
    aside = move_aside(path, why) if why is not None else None
    for attempt in range(2):
        os.makedirs(path, exist_ok=True)
        try:  # only this process uses it: a stale or damaged reader table is never needed
            os.unlink(os.path.join(path, "lock.mdb"))
        except FileNotFoundError:
            pass
        try:
            return lmdb.open(path, **options), aside  # type: ignore[arg-type]
        except lmdb.Error as error:
            if attempt:
                raise
            if not repair_meta(path):
                aside = move_aside(path, f"LMDB will not open it: {error}")
    raise AssertionError("unreachable")


def main(argv: list[str]) -> int:
    deep = "--deep" in argv
    path = next(a for a in argv if not a.startswith("--"))
    try:
        result = survey(path, deep)
    except lmdb.Error as error:
        print(f"LMDB reports it broken: {error}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
