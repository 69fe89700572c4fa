"""The disk tier's record format, in one place: what disk.py writes, what recovery.py
and the drills check without opening the tier.

An LMDB environment with two databases: `meta` maps an entry's key to a sealed header,
`data` to its bytes. The key is one kind byte (Kind) and the 16-byte page key. The
header: magic, kind, format version, depth, payload bytes, checksum of the payload,
creation time (ns since the epoch) and check (what a match must bring to hit the entry:
index.Index.usable); then a checksum of the key and all of the above, so that a damaged
header is caught by a scan alone.
"""

from __future__ import annotations

import struct

import xxhash

from tiercache.hashing import KEY_BYTES
from tiercache.results import Kind

META_DB, DATA_DB = b"meta", b"data"
DB_KEY_BYTES = 1 + KEY_BYTES
HEADER = struct.Struct("<4sBBxxIQQqQ")
SEALED = struct.Struct(f"{HEADER.format}Q")
MAGIC = b"TCE1"
VERSION = 2


def db_key(kind: Kind, key: bytes) -> bytes:
    return bytes((kind,)) + key


def kind_of(dkey: bytes) -> Kind | None:
    """The entry kind a database key names, or None if it names none."""
    if len(dkey) != DB_KEY_BYTES or dkey[0] not in (Kind.PAGE, Kind.CHECKPOINT):
        return None
    return Kind(dkey[0])


def checksum(kind: Kind, key: bytes, depth: int, check: int, payload: object) -> int:
    hasher = xxhash.xxh3_64(db_key(kind, key))
    hasher.update(struct.pack("<IQ", depth, check))
    hasher.update(payload)  # type: ignore[arg-type]
    return hasher.intdigest()


def seal(dkey: bytes, fields: bytes) -> bytes:
    return fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(dkey + fields))


def header(kind: Kind, key: bytes, depth: int, payload: memoryview, check: int, created: int) -> bytes:
    """The sealed header of an entry about to be written."""
    return seal(db_key(kind, key), HEADER.pack(MAGIC, kind, VERSION, depth, payload.nbytes,
                                                checksum(kind, key, depth, check, payload),
                                                created, check))


def parse(kind: Kind, key: bytes, sealed: bytes) -> tuple[int, int, int, int, int] | None:
    """(depth, nbytes, checksum, created_ns, check), or None for a damaged header."""
    if len(sealed) != SEALED.size or seal(db_key(kind, key), sealed[:HEADER.size]) != sealed:
        return None
    magic, hkind, version, depth, nbytes, digest, created, check = HEADER.unpack_from(sealed)
    if magic != MAGIC or hkind != kind or version != VERSION:
        return None
    return depth, nbytes, digest, created, check


def verify_entry(dkey: bytes, sealed: bytes, payload: memoryview | None, deep: bool) -> int | None:
    """The size of a stored entry if its header is sound and its value has that size (and,
    if `deep`, that checksum); None otherwise."""
    kind = kind_of(dkey)
    if kind is None or payload is None:
        return None
    key = dkey[1:]
    record = parse(kind, key, sealed)
    if record is None or record[1] != len(payload):
        return None
    if deep and record[2] != checksum(kind, key, record[0], record[4], payload):
        return None
    return record[1]
