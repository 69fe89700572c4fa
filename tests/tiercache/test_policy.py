import numpy as np
import pytest

from tiercache.errors import InvalidArgument
from tiercache.index import Candidates
from tiercache.policy import (AdmissionConfig, FlopAware, Lru, PolicyConfig, WriteConfig,
                              make_policy)


def candidates(stamps, depths, values=None):
    n = len(stamps)
    values = np.zeros(n) if values is None else values
    return Candidates(np.arange(n), np.array(stamps, np.uint64), np.array(depths, np.uint32),
                      np.zeros(n, np.uint8), np.full(n, 10, np.int64), np.array(values, np.float32))


def test_lru_evicts_the_oldest_first_and_deeper_pages_first_among_equals():
    # rows 0..2 were used together at stamp 5 (depths 1, 2, 3); row 3 at stamp 2; row 4 at 9
    order = Lru().order(candidates([5, 5, 5, 2, 9], [1, 2, 3, 7, 1]))
    assert list(order) == [3, 2, 1, 0, 4]


@pytest.mark.parametrize("policy", [Lru(), FlopAware(0.0), FlopAware(1.0), FlopAware(50.0)])
def test_every_policy_evicts_a_chain_used_together_leaf_first(policy):
    # one chain of 5 pages used at stamp 7, worth the same per byte all along
    order = policy.order(candidates([7] * 5, [1, 2, 3, 4, 5], [3.0] * 5))
    assert list(order) == [4, 3, 2, 1, 0]


def test_flop_aware_with_alpha_0_is_lru():
    many = candidates([5, 5, 5, 2, 9, 2], [1, 2, 3, 7, 1, 2], [1, 9, 3, 0, 4, 8])
    assert list(FlopAware(0.0).order(many)) == list(Lru().order(many))


def test_flop_aware_keeps_old_entries_that_save_more_per_byte():
    # chain A (rows 0..2) used at stamp 5, worth 1 per byte; chain B (rows 3, 4) at stamp 4,
    # worth 10 per byte. Recency scales to A = 1, B = 0; worth to A = 0.1, B = 1.
    many = candidates([5, 5, 5, 4, 4], [1, 2, 3, 1, 2], [1, 1, 1, 10, 10])
    # LRU: the older chain B goes first, leaf first
    assert list(Lru().order(many)) == [4, 3, 2, 1, 0]
    # alpha 1: A scores 1 + 0.1, B 0 + 1: B still goes first
    assert list(FlopAware(1.0).order(many)) == [4, 3, 2, 1, 0]
    # alpha 2: A scores 1.2, B 2: the recent but cheap chain A goes first
    assert list(FlopAware(2.0).order(many)) == [2, 1, 0, 4, 3]


def test_flop_aware_handles_a_single_stamp_and_no_values():
    # no spread of stamps and every value 0: nothing to scale, no division by zero
    assert list(FlopAware(1.0).order(candidates([3, 3], [1, 2]))) == [1, 0]
    assert list(FlopAware(1.0).order(candidates([], []))) == []


def test_make_policy_takes_a_config_or_a_name():
    assert make_policy("lru") == Lru()
    assert make_policy(PolicyConfig(eviction="flop", alpha=0.5)) == FlopAware(0.5)


@pytest.mark.parametrize("build, message", [
    (lambda: make_policy("random"), "'random' is unknown: use one of"),
    (lambda: PolicyConfig(alpha=-1), "alpha must be a finite number >= 0"),
    (lambda: PolicyConfig(alpha=float("nan")), "alpha"),
    (lambda: PolicyConfig(tune_alpha=True), "tune_alpha needs eviction='flop'"),
    (lambda: AdmissionConfig(offered="some"), "admission.offered 'some' is unknown"),
    (lambda: AdmissionConfig(interval=-2), "interval must be a non-negative integer"),
    (lambda: WriteConfig(host="around"), "writes.host 'around' is unknown"),
    (lambda: WriteConfig(batch_entries=0), "batch_entries must be a positive integer"),
    (lambda: WriteConfig(clean_ahead=1.5), "clean_ahead must lie in"),
])
def test_bad_policy_config_is_refused_with_the_field_named(build, message):
    with pytest.raises(InvalidArgument, match=message):
        build()
