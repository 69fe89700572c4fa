"""How one cache entry lies in a shared key-value store: its parts first, a sealed
metadata record last.

Every key carries the store's prefix and, inside a hash tag, the namespace and the
entry's kind and page key: `tc:{<ns>:p:<key hex>}:m` for the metadata, `...:0`,
`...:1` for the parts. Redis Cluster places a key by its hash tag alone, so one
entry's parts and its metadata share a slot (one node, one pipeline), while distinct
pages, whose keys are uniform hashes, spread evenly over the cluster. Nothing in a tag
names a request or a prefix: that would make a hot slot.

Values larger than `part_bytes` are split into parts (Redis refuses values over
`proto-max-bulk-len`, and a large value blocks its event loop while it is copied). A
writer stores the parts, then the metadata; a reader trusts nothing: the metadata is
sealed by a checksum over its own key and fields, it names the entry's size, part
layout and a checksum of the bytes, and the reader checks each part's length and the
checksum of the whole before it calls the entry found (invariant 4). The store may evict
any key at any moment (allkeys-lru), so a part can vanish under its metadata: that is a
miss, never a half entry.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Iterable

import xxhash

from tiercache.errors import InvalidArgument
from tiercache.hashing import KEY_BYTES
from tiercache.results import Kind

MiB = 1 << 20
MAX_PART_BYTES = 512 * MiB  # Redis' default proto-max-bulk-len: no value may be larger

_KIND_LETTER = {Kind.PAGE: "p", Kind.CHECKPOINT: "c"}
# magic, format version, kind, depth, entry bytes, part bytes, parts, checksum of the
# bytes, check (what a match must bring: index.Index.verified), created (ns since epoch)
_FIELDS = struct.Struct("<4sBBxxIQIIQQq")
_SEAL = struct.Struct("<Q")
META_BYTES = _FIELDS.size + _SEAL.size
_MAGIC = b"TCR1"
_VERSION = 1


@dataclass(frozen=True)
class EntryRef:
    """An entry as a caller names it."""

    kind: Kind
    key: bytes  # the 16-byte page key, as the engine stores it (tenant-masked)

    def __post_init__(self) -> None:
        if len(self.key) != KEY_BYTES:
            raise InvalidArgument(f"a page key is {KEY_BYTES} bytes, got {len(self.key)}")


@dataclass(frozen=True)
class Meta:
    """What the metadata record says about a stored entry."""

    kind: Kind
    depth: int  # pages in the prefix the entry ends
    nbytes: int
    part_bytes: int
    parts: int
    checksum: int
    check: int  # 0: stored by a caller that sent no checks
    created_ns: int


@dataclass(frozen=True)
class Keys:
    """The store keys of one entry: its metadata and its parts."""

    meta: bytes
    parts: tuple[bytes, ...]


def check_namespace(namespace: str) -> str:
    """A namespace may hold letters, digits, '-', '_' and '.': no braces or colons,
    which would move the hash tag or make two namespaces' keys meet."""
    if not namespace or not all(c.isalnum() or c in "-_." for c in namespace):
        raise InvalidArgument(f"remote namespace {namespace!r} must be non-empty letters, "
                              "digits, '-', '_' or '.'")
    return namespace


def part_count(nbytes: int, part_bytes: int) -> int:
    """Parts of an entry of `nbytes` (at least one: an empty entry is one empty part)."""
    return max(1, -(-nbytes // part_bytes))


def part_spans(nbytes: int, part_bytes: int) -> list[tuple[int, int]]:
    """(start, end) of each part in the entry's bytes."""
    return [(start, min(start + part_bytes, nbytes))
            for start in range(0, part_count(nbytes, part_bytes) * part_bytes, part_bytes)]


def entry_keys(prefix: str, namespace: str, ref: EntryRef, parts: int) -> Keys:
    tag = f"{prefix}:{{{namespace}:{_KIND_LETTER[ref.kind]}:{ref.key.hex()}}}:"
    return Keys((tag + "m").encode(), tuple(f"{tag}{i}".encode() for i in range(parts)))


def meta_keys(prefix: str, namespace: str, refs: list[EntryRef]) -> list[bytes]:
    """The metadata keys of `refs` (as entry_keys names them): a lookup names thousands."""
    heads = {kind: f"{prefix}:{{{namespace}:{letter}:".encode() for kind, letter in _KIND_LETTER.items()}
    return [heads[ref.kind] + ref.key.hex().encode() + b"}:m" for ref in refs]


def checksum(ref: EntryRef, depth: int, check: int, parts: Iterable[object]) -> int:
    """xxh3-64 of the entry's identity and bytes: a value moved under another key, or
    written by another store of the same key whose bytes differ, fails it."""
    hasher = xxhash.xxh3_64(bytes((ref.kind,)) + ref.key)
    hasher.update(struct.pack("<IQ", depth, check))
    for part in parts:
        hasher.update(part)  # type: ignore[arg-type]
    return hasher.intdigest()


def seal(meta_key: bytes, meta: Meta) -> bytes:
    """The metadata record: its fields and a checksum over its key and fields."""
    fields = _FIELDS.pack(_MAGIC, _VERSION, meta.kind, meta.depth, meta.nbytes,
                          meta.part_bytes, meta.parts, meta.checksum, meta.check,
                          meta.created_ns)
    return fields + _SEAL.pack(xxhash.xxh3_64_intdigest(meta_key + fields))


def new_meta(ref: EntryRef, depth: int, check: int, payload: memoryview,
             part_bytes: int) -> Meta:
    spans = part_spans(payload.nbytes, part_bytes)
    total = checksum(ref, depth, check, (payload[a:b] for a, b in spans))
    return Meta(ref.kind, depth, payload.nbytes, part_bytes, len(spans), total, check,
                time.time_ns())


def parse(meta_key: bytes, ref: EntryRef, record: bytes | None) -> Meta | None:
    """The metadata in `record`, or None if it is missing, damaged, of another format
    version, or not about `ref`."""
    if record is None or len(record) != META_BYTES:
        return None
    fields = record[:_FIELDS.size]
    if _SEAL.unpack(record[_FIELDS.size:])[0] != xxhash.xxh3_64_intdigest(meta_key + fields):
        return None
    magic, version, kind, depth, nbytes, part_bytes, parts, total, check, created = \
        _FIELDS.unpack(fields)
    if magic != _MAGIC or version != _VERSION or kind != ref.kind or not part_bytes:
        return None
    if parts != part_count(nbytes, part_bytes):
        return None
    return Meta(Kind(kind), depth, nbytes, part_bytes, parts, total, check, created)
