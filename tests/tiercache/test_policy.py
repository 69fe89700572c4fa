import numpy as np
import pytest

from tiercache.errors import InvalidArgument
from tiercache.index import Candidates
from tiercache.policy import Lru, make_policy


def candidates(stamps, depths):
    n = len(stamps)
    return Candidates(np.arange(n), np.array(stamps, np.uint64), np.array(depths, np.uint32),
                      np.zeros(n, np.uint8), np.full(n, 10, np.int64))


def test_lru_evicts_the_oldest_first_and_deeper_pages_first_among_equals():
    # rows 0..2 were used together at stamp 5 (depths 1, 2, 3); row 3 at stamp 2; row 4 at 9
    order = Lru().order(candidates([5, 5, 5, 2, 9], [1, 2, 3, 7, 1]))
    assert list(order) == [3, 2, 1, 0, 4]


def test_unknown_policy_is_refused():
    assert make_policy("lru").name == "lru"
    with pytest.raises(InvalidArgument, match="lru"):
        make_policy("random")
