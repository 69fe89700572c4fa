"""Ids as the engine takes them (buffers.int_ids): a list of ints by a fast path, and every
other input as before it, to the same array or the same error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercache.buffers import int_ids, row_ids
from tiercache.errors import InvalidArgument


@pytest.mark.parametrize("rows", [
    [0], [5, 3, 9], list(range(5461)), (7, 1, 2), [2**32 - 1, 0], [np.int64(4), 5],
    [1, True, 2],  # a bool after an int is 1, as np.asarray makes it
    [2**32, 1], [-1, 3], [3, -1], [2**63 - 1], [0.5, 1.5], [1, 2.0], ["1"], [[1, 2]],
    [True, False], [None], [1, None], [], (),
])
def test_a_list_gives_what_the_general_path_gives(rows):
    try:  # an array never takes the fast path: the general path's answer for the same ids
        expected = int_ids(np.asarray(rows), "kv rows")
    except InvalidArgument as error:
        assert "flat list of integers" in str(error)
        with pytest.raises(InvalidArgument, match="flat list of integers"):
            int_ids(rows, "kv rows")
        return
    got = int_ids(rows, "kv rows")
    assert got.dtype == np.int64 and np.array_equal(got, expected)


def test_rows_out_of_range_are_named_from_a_list_as_from_an_array():
    for rows in ([3, -1], [0, 2**32], [0, 70]):
        with pytest.raises(InvalidArgument, match=f"kv rows {rows[1]} is out of range"):
            row_ids(rows, 64, "kv rows")
        with pytest.raises(InvalidArgument, match=f"kv rows {rows[1]} is out of range"):
            row_ids(np.array(rows), 64, "kv rows")
    assert np.array_equal(row_ids(torch.tensor([1, 2]), 4, "kv rows"), [1, 2])


def test_a_list_of_ints_takes_the_fast_path(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("np.asarray called for a list of ints")
    monkeypatch.setattr(np, "asarray", refused)
    assert np.array_equal(int_ids([4, 0, 7], "kv rows"), np.array([4, 0, 7]))
    with pytest.raises(AssertionError):  # and anything else goes the general way
        int_ids([4, -1], "kv rows")


def test_the_row_check_finds_the_first_row_out_of_range_or_repeated():
    rng = np.random.default_rng(3)
    for _ in range(200):  # against the rule written out in numpy
        limit = int(rng.integers(1, 300))
        rows = rng.integers(-2, limit + 2, rng.integers(0, 40))
        bad = np.flatnonzero((rows < 0) | (rows >= limit))
        repeats = [i for i in range(len(rows)) if rows[i] in rows[:i]]
        first = min([*bad[:1].tolist(), *repeats[:1]], default=None)
        if first is None:
            assert np.array_equal(row_ids(rows, limit, "kv row", unique=True), rows)
            continue
        why = "out of range" if first in bad else "repeat a row"
        with pytest.raises(InvalidArgument, match=why):
            row_ids(rows, limit, "kv row", unique=True)
        if not len(bad):  # repeats are only refused when asked to be
            assert np.array_equal(row_ids(rows, limit, "kv row"), rows)
