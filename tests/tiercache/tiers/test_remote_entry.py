"""The remote entry format on its own: keys, parts and the sealed metadata record."""

from __future__ import annotations

import os

import pytest

from tiercache.results import Kind
from tiercache.tiers.remote import entry as fmt
from tiercache.tiers.remote.entry import EntryRef


def test_keys_tag_the_namespace_kind_and_page_key_and_nothing_else():
    ref = EntryRef(Kind.CHECKPOINT, bytes(range(16)))
    keys = fmt.entry_keys("tc", "fleet", ref, 2)
    tag = b"tc:{fleet:c:000102030405060708090a0b0c0d0e0f}:"
    assert keys == fmt.Keys(tag + b"m", (tag + b"0", tag + b"1"))
    assert fmt.meta_keys("tc", "fleet", [ref]) == [keys.meta]
    # a page and a checkpoint of the same key are two entries in different slots' tags
    assert fmt.entry_keys("tc", "fleet", EntryRef(Kind.PAGE, ref.key), 0).meta != keys.meta


def test_parts_cover_the_bytes_exactly():
    assert fmt.part_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert fmt.part_spans(8, 4) == [(0, 4), (4, 8)]
    assert fmt.part_spans(0, 4) == [(0, 0)]  # an empty entry is one empty part
    assert fmt.part_count(10, 4) == 3


def test_a_sealed_record_parses_back_and_any_change_breaks_it():
    ref = EntryRef(Kind.PAGE, os.urandom(16))
    payload = memoryview(os.urandom(1000))
    meta = fmt.new_meta(ref, depth=3, check=99, payload=payload, part_bytes=300)
    key = fmt.entry_keys("tc", "ns", ref, 0).meta
    record = fmt.seal(key, meta)
    assert fmt.parse(key, ref, record) == meta
    assert (meta.parts, meta.nbytes) == (4, 1000)
    # each byte flipped, the record read under another key or for another kind: None
    for i in range(len(record)):
        assert fmt.parse(key, ref, record[:i] + bytes([record[i] ^ 1]) + record[i + 1:]) is None
    other = EntryRef(Kind.PAGE, os.urandom(16))
    assert fmt.parse(fmt.entry_keys("tc", "ns", other, 0).meta, other, record) is None
    assert fmt.parse(key, EntryRef(Kind.CHECKPOINT, ref.key), record) is None
    assert fmt.parse(key, ref, None) is None and fmt.parse(key, ref, record[:-1]) is None


def test_the_checksum_covers_identity_and_every_byte():
    ref = EntryRef(Kind.PAGE, os.urandom(16))
    data = bytearray(os.urandom(64))
    base = fmt.checksum(ref, 1, 0, [data[:32], data[32:]])
    assert base == fmt.checksum(ref, 1, 0, [bytes(data)])  # however it is split
    assert base != fmt.checksum(ref, 2, 0, [data])  # another depth
    assert base != fmt.checksum(ref, 1, 5, [data])  # another check
    assert base != fmt.checksum(EntryRef(Kind.CHECKPOINT, ref.key), 1, 0, [data])
    data[7] ^= 1
    assert base != fmt.checksum(ref, 1, 0, [data])


def test_names_that_would_move_the_hash_tag_are_refused():
    for bad in ("", "a}b", "a{b", "a:b", "a b"):
        with pytest.raises(ValueError, match="namespace"):
            fmt.check_namespace(bad)
    with pytest.raises(ValueError, match="16 bytes"):
        EntryRef(Kind.PAGE, b"short")
