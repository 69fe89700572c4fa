import numpy as np

from tiercache.keymap import KeyMap


def crowded(keymap, slots):
    """Keys whose first slot in `keymap`'s table is each of `slots`: its salts set to 1
    and 1, so a key's first slot is the top bits of lo + hi (hi is 0 here)."""
    keymap._salts = (1, 1)
    shift = 64 - (len(keymap._table) - 1).bit_length()
    return np.array([[(int(slot) << shift) + i, 0] for i, slot in enumerate(slots)], np.uint64)


def random_keys(rng, n):
    return rng.integers(0, 2**63, (n, 2), dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, (n, 2), dtype=np.uint64)


def test_lookups_follow_a_dict_through_inserts_deletes_and_rehashes():
    rng = np.random.default_rng(0)
    keymap, model = KeyMap(), {}
    pool = random_keys(rng, 5000)
    for step in range(60):
        # insert a batch of absent keys, delete a batch of present ones, then compare all
        absent = [i for i in rng.permutation(len(pool))[:300] if i not in model][:200]
        rows = rng.integers(0, 2**31 - 1, len(absent))
        keymap.insert(pool[absent], rows)
        model.update(zip(absent, rows.tolist()))
        present = list(model)
        gone = [present[i] for i in rng.permutation(len(present))[:150]]
        keymap.delete(pool[gone])
        for i in gone:
            del model[i]
        expected = np.array([model.get(i, -1) for i in range(len(pool))])
        assert np.array_equal(keymap.lookup(pool), expected), f"step {step}"
        assert len(keymap) == len(model)


def test_keys_that_share_their_low_half_are_told_apart():
    keys = np.array([[7, 1], [7, 2], [7 + 1024, 3], [8, 1]], np.uint64)
    keymap = KeyMap()
    keymap.insert(keys[:3], np.array([10, 20, 30]))
    assert list(keymap.lookup(keys)) == [10, 20, 30, -1]
    keymap.delete(keys[1:2])
    assert list(keymap.lookup(keys)) == [10, -1, 30, -1]  # probing goes past the tombstone
    keymap.insert(keys[3:], np.array([40]))
    assert list(keymap.lookup(keys)) == [10, -1, 30, 40]


def test_a_batch_that_collides_with_itself_lands_in_distinct_slots():
    keymap = KeyMap()
    keys = crowded(keymap, [5] * 50)
    keymap.insert(keys, np.arange(50))
    assert list(keymap.lookup(keys)) == list(range(50))


def test_an_insert_with_a_repeated_or_present_key_is_refused_and_undone():
    import pytest
    from tiercache.keymap import DuplicateKey
    keymap = KeyMap()
    keys = crowded(keymap, [5] * 6)
    keymap.insert(keys[:2], np.array([0, 1]))
    keymap.delete(keys[:1])  # a tombstone at slot 5, key 1 behind it
    # a batch that names key 3 twice: refused, and the slots it took are given back
    with pytest.raises(DuplicateKey, match="key 3 of the batch repeats"):
        keymap.insert(keys[[2, 3, 4, 3]], np.array([2, 3, 4, 5]))
    assert list(keymap.lookup(keys)) == [-1, 1, -1, -1, -1, -1] and len(keymap) == 1
    # a key the map holds, even behind the tombstone an insert would take first
    with pytest.raises(DuplicateKey, match="key 1 of the batch is in the map"):
        keymap.insert(keys[[0, 1]], np.array([7, 8]))
    assert list(keymap.lookup(keys)) == [-1, 1, -1, -1, -1, -1] and len(keymap) == 1
    keymap.insert(keys[[0, 2, 3]], np.array([0, 2, 3]))  # distinct, absent keys go in
    assert list(keymap.lookup(keys)) == [0, 1, 2, 3, -1, -1]


def test_a_repeat_among_long_probes_is_refused_and_undone():
    """A repeat at the end of a long probe (120 keys of one slot) is found, and every
    slot the batch took is given back."""
    import pytest
    from tiercache.keymap import DuplicateKey
    keymap = KeyMap(4096)
    keys = crowded(keymap, [5] * 120)
    keymap.insert(keys[:1], np.array([0]))
    batch = np.concatenate([keys[1:], keys[100:101]])  # key 100 again, last
    with pytest.raises(DuplicateKey, match=f"key {len(batch) - 1} of the batch repeats"):
        keymap.insert(batch, np.arange(len(batch)))
    assert list(keymap.lookup(keys)) == [0] + [-1] * 119 and len(keymap) == 1
    keymap.insert(keys[1:], np.arange(1, 120))
    assert list(keymap.lookup(keys)) == list(range(120))


def test_clustered_keys_follow_a_dict_across_the_tables_end():
    """Keys crowded onto a few slots next to the table's last one: probes run long and
    wrap around to slot 0; inserts reuse tombstones, deletes clear them behind them."""
    rng = np.random.default_rng(1)
    keymap, model = KeyMap(), {}
    pool = crowded(keymap, np.array([1021, 1022, 1023, 0, 3])[np.arange(300) % 5])
    for step in range(40):
        absent = [i for i in rng.permutation(len(pool))[:40] if i not in model][:25]
        rows = rng.integers(0, 2**40, len(absent))
        keymap.insert(pool[absent], rows)
        model.update(zip(absent, rows.tolist()))
        gone = [i for i in model if rng.random() < 0.3]
        keymap.delete(pool[gone])
        for i in gone:
            del model[i]
        expected = [model.get(i, -1) for i in range(len(pool))]
        assert keymap.lookup(pool).tolist() == expected, f"step {step}"
        assert [keymap.get(key) for key in pool[:20]] == expected[:20]
        assert len(keymap) == len(model)


def longest_run(occupied: np.ndarray) -> int:
    """The most consecutive occupied slots of a circular table."""
    if occupied.all():
        return len(occupied)
    start = int(np.flatnonzero(~occupied)[0])
    run = best = 0
    for taken in np.roll(occupied, -start).tolist():
        run = run + 1 if taken else 0
        best = max(best, run)
    return best


def test_keys_chosen_to_share_a_slot_do_not_crowd_it():
    """A client picks its keys: keys whose low bits, or whose halves' sum, are all alike
    still spread over the table, so probes stay short, under fresh salts and under the
    salts that line each set up (lo * a + hi * b = n * 2^51 + constant: with a product
    alone for a hash, the keys would take consecutive slots of an 8,192-slot table; with
    random salts that happened in about one table of a hundred). Under the old first
    slot, lo & mask, each set was one run."""
    n = np.arange(2000, dtype=np.uint64)
    step = 2**51  # 2^64 / 8,192 slots: one slot a key under a product alone
    attacks = {"low bits alike": (np.stack([n << np.uint64(40), n], axis=1), (1, step - 2**40 + 1)),
               "sum alike": (np.stack([n, np.uint64(2**63) - n], axis=1), (step + 1, 1)),
               "one low half": (np.stack([np.full(2000, 7, np.uint64), n], axis=1), (1, step + 1))}
    for name, (keys, lined_up) in attacks.items():
        for salts in [None] * 20 + [lined_up]:
            keymap = KeyMap()
            if salts is not None:
                keymap._salts = salts
            keymap.insert(keys, np.arange(2000))
            assert len(keymap._table) == 8192
            assert longest_run(keymap._table[:, 2] >= 2) < 60, (name, salts)  # random keys: 10-20
            assert keymap.lookup(keys).tolist() == list(range(2000)), name


def test_keys_are_a_uint64_pair_array_and_other_views_of_them_are_read_right():
    keys = np.arange(40, dtype=np.uint64).reshape(10, 4)
    keymap = KeyMap()
    keymap.insert(keys[:, ::2], np.arange(10))  # not contiguous: read as the values it shows
    assert keymap.lookup(np.ascontiguousarray(keys[:, ::2])).tolist() == list(range(10))
    assert keymap.lookup(keys[:, 1::2]).tolist() == [-1] * 10
    import pytest
    with pytest.raises(ValueError, match="uint64 \\(n, 2\\)"):
        keymap.lookup(keys.astype(np.int64)[:, :2])
    with pytest.raises(ValueError, match="rows are >= 0"):
        keymap.insert(keys[:1, 1:3], np.array([-1]))
    with pytest.raises(ValueError, match="1 keys with 2 rows"):
        keymap.insert(keys[:1, 1:3], np.array([1, 2]))
    assert len(keymap) == 10


def test_the_c_loops_refuse_bad_arguments_and_slots_without_a_record():
    import pytest
    from tiercache import _keymap
    table = np.zeros((1024, 3), np.uint64)
    keys = np.array([[5, 6]], np.uint64)
    out = np.empty(1, np.int64)
    with pytest.raises(ValueError, match="mask must be a power of two less one"):
        _keymap.find(table, 1000, 1, 1, keys, out, out)
    with pytest.raises(ValueError, match="salts must be odd"):
        _keymap.find(table, 1023, 2, 1, keys, out, out)
    with pytest.raises(ValueError, match="table holds 24576 bytes, expected 49152"):
        _keymap.find(table, 2047, 1, 1, keys, out, out)
    with pytest.raises(ValueError, match="slots holds 16 bytes, expected 8"):
        _keymap.find(table, 1023, 1, 1, keys, np.empty(2, np.int64), out)
    with pytest.raises(TypeError):
        _keymap.insert(table.copy(order="F"), 1023, 1, 1, keys, np.zeros(1, np.int64), False)
    assert _keymap.insert(table, 1023, 1, 1, keys, np.array([9], np.int64), False) == (-1, 0, 0)
    at = int(np.flatnonzero(table[:, 2])[0])
    assert table[at].tolist() == [5, 6, 11]
    with pytest.raises(ValueError, match=f"slot {(at + 1) % 1024} holds no record"):
        _keymap.delete(table, 1023, np.array([at, (at + 1) % 1024], np.int64))
    assert table[at].tolist() == [5, 6, 11]  # the refused delete changed nothing
    assert _keymap.delete(table, 1023, np.array([at], np.int64)) == 1  # its tombstone cleared
    assert table[at, 2] == 0


def test_a_table_without_an_empty_slot_ends_every_probe():
    """KeyMap keeps its table at most half full; the C loops still end on a full one."""
    import pytest
    from tiercache import _keymap
    table = np.zeros((1024, 3), np.uint64)
    table[:, 0], table[:, 2] = np.arange(1024), 2  # 1,024 live records, no empty slot
    out = np.empty(1, np.int64)
    absent = np.array([[5000, 1]], np.uint64)
    _keymap.find(table, 1023, 1, 1, absent, out, out)
    assert out.tolist() == [-1]
    before = table.copy()
    with pytest.raises(ValueError, match="no free slot"):
        _keymap.insert(table, 1023, 1, 1, absent, np.array([3], np.int64), True)
    assert np.array_equal(table, before)
    with pytest.raises(ValueError, match="mask must be"):
        _keymap.find(table, 2**63 - 1, 1, 1, absent, out, out)
