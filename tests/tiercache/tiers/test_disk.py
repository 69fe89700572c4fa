import lmdb
import numpy as np
import pytest

from tiercache.hashing import Namespace, page_keys
from tiercache.results import Kind
from tiercache.tiers.disk import DiskConfig, DiskFull, DiskTier, as_array

KEYS = page_keys(list(range(16 * 4)), Namespace("m", "fp").root(), 16)


def payload(seed, size=5000):
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def flip_byte(path, kind, key, position):
    """Damage a stored value behind the tier's back, the way bit rot would."""
    env = lmdb.open(path, max_dbs=2)
    data = env.open_db(b"data")
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(bytes((kind,)) + key, db=data))
        value[position] ^= 0x40
        txn.put(bytes((kind,)) + key, bytes(value), db=data)
    env.close()


@pytest.fixture
def disk(tmp_path):
    tier = DiskTier.open(DiskConfig(str(tmp_path), map_size=1 << 22))
    yield tier
    tier.close()


def test_entries_round_trip_and_are_read_without_a_copy(disk):
    disk.write([(Kind.PAGE, KEYS[0], 1, payload(0)), (Kind.CHECKPOINT, KEYS[0], 1, payload(1, 300))])
    assert disk.used_bytes == 5300
    with disk.reader() as reader:
        page = reader.get(Kind.PAGE, KEYS[0])
        assert isinstance(page, memoryview)
        assert np.array_equal(as_array(page), payload(0))
        assert np.array_equal(as_array(reader.get(Kind.CHECKPOINT, KEYS[0])), payload(1, 300))
        assert reader.get(Kind.PAGE, KEYS[1]) is None


def test_a_flipped_byte_is_a_miss_and_is_counted(disk, tmp_path):
    disk.write([(Kind.PAGE, KEYS[0], 1, payload(0)), (Kind.PAGE, KEYS[1], 2, payload(1))])
    disk.close()
    flip_byte(str(tmp_path), Kind.PAGE, KEYS[1], 1234)
    tier = DiskTier.open(DiskConfig(str(tmp_path), map_size=1 << 22))
    with tier.reader() as reader:
        assert reader.get(Kind.PAGE, KEYS[1]) is None  # damaged: never served
        assert np.array_equal(as_array(reader.get(Kind.PAGE, KEYS[0])), payload(0))
    assert tier.checksum_failures == 1
    tier.close()


def test_scan_lists_entries_oldest_first_and_drops_damaged_headers(disk, tmp_path):
    disk.write([(Kind.PAGE, KEYS[0], 1, payload(0))])
    disk.write([(Kind.PAGE, KEYS[1], 2, payload(1)), (Kind.CHECKPOINT, KEYS[1], 2, payload(2, 64))])
    with disk.env.begin(write=True) as txn:  # a header cut short
        txn.put(bytes((Kind.PAGE,)) + KEYS[2], b"TCE1", db=disk.meta_db)
        txn.put(bytes((Kind.PAGE,)) + KEYS[2], b"x" * 10, db=disk.data_db)
    records = disk.scan()
    assert [(r.kind, r.key, r.depth, r.nbytes) for r in records][0] == (Kind.PAGE, KEYS[0], 1, 5000)
    assert {(r.kind, r.key) for r in records[1:]} == {(Kind.PAGE, KEYS[1]), (Kind.CHECKPOINT, KEYS[1])}
    assert disk.checksum_failures == 1 and disk.used_bytes == 10064
    with disk.reader() as reader:
        assert reader.get(Kind.PAGE, KEYS[2]) is None


def test_writing_an_entry_twice_keeps_one_copy(disk):
    disk.write([(Kind.PAGE, KEYS[0], 1, payload(0))])
    disk.write([(Kind.PAGE, KEYS[0], 1, payload(0))])
    assert disk.used_bytes == 5000 and len(disk.scan()) == 1


def test_a_full_map_is_reported_and_the_batch_is_not_written(disk):
    big = [(Kind.PAGE, key, n + 1, payload(n, 1 << 20)) for n, key in enumerate(KEYS)]
    with pytest.raises(DiskFull, match="full"):
        disk.write(big)  # 4 MiB of values do not fit a 4 MiB map with its overhead
    assert disk.scan() == [] and disk.used_bytes == 0
    disk.write(big[:2])  # the environment stays usable
    assert len(disk.scan()) == 2


def test_deleted_entries_are_gone(disk):
    disk.write([(Kind.PAGE, KEYS[0], 1, payload(0)), (Kind.PAGE, KEYS[1], 2, payload(1))])
    disk.delete([(Kind.PAGE, KEYS[0])])
    assert [r.key for r in disk.scan()] == [KEYS[1]] and disk.used_bytes == 5000
