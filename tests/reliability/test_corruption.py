"""Invariant 4 against damaged disks: a damaged entry is a counted miss, never served;
an environment that will not open is moved aside, loudly, and the tier starts empty.
Each damaged tier is opened and read in a child process, so a crash would show as one
(`benchmarks.corruption` runs many random rounds of the same)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from drills import damage

PROMPTS = 12


@pytest.fixture
def tier(tmp_path):
    damage.store(str(tmp_path), PROMPTS)
    return str(tmp_path)


def test_an_undamaged_tier_serves_every_prompt_exactly(tier):
    result = damage.check_in_child(tier, PROMPTS)
    assert (result["exact"], result["checksum_failures"], result["moved_aside"]) == (PROMPTS, 0, 0)


def test_flipped_bits_in_values_are_counted_misses(tier):
    hit = damage.flip_values(tier, np.random.default_rng(1), count=6)
    result = damage.check_in_child(tier, PROMPTS)
    # every damaged value was caught by its checksum; no prompt got a wrong byte
    assert result["wrong"] == 0 and result["checksum_failures"] == hit
    assert result["exact"] + result["partial"] + result["missed"] == PROMPTS
    assert result["exact"] <= PROMPTS - 1 and result["moved_aside"] == 0


def test_values_cut_short_are_counted_misses(tier):
    hit = damage.cut_values(tier, np.random.default_rng(2), count=4)
    result = damage.check_in_child(tier, PROMPTS)
    assert result["wrong"] == 0 and result["checksum_failures"] == hit


def test_damaged_headers_are_dropped_and_counted_when_the_index_is_rebuilt(tier):
    hit = damage.flip_values(tier, np.random.default_rng(3), count=5, db=b"meta")
    result = damage.check_in_child(tier, PROMPTS)
    assert result["wrong"] == 0 and result["checksum_failures"] == hit


def test_a_garbage_lock_file_is_rebuilt_and_loses_nothing(tier):
    damage.garbage_lock(tier, np.random.default_rng(4))
    result = damage.check_in_child(tier, PROMPTS)
    assert (result["exact"], result["moved_aside"]) == (PROMPTS, 0)


@pytest.mark.parametrize("page", [0, 1])
def test_one_damaged_meta_page_is_restored_from_the_other(tier, page):
    # LMDB keeps two meta pages for this: the environment is kept, not moved aside, and
    # what it serves is exact (a prompt of the last commit may be missing, nothing wrong)
    damage.garble_meta_page(tier, page, np.random.default_rng(6))
    result = damage.check_in_child(tier, PROMPTS)
    assert "crashed" not in result and "failed" not in result, result
    assert result["moved_aside"] == 0 and result["wrong"] == 0
    assert result["exact"] >= PROMPTS - 1 and "restored it from meta page" in result["log"]


@pytest.mark.parametrize("break_it", [
    damage.zero_meta_pages,
    lambda path: damage.garbage_file(path, np.random.default_rng(5)),
], ids=["meta pages zeroed", "not an LMDB file"])
def test_an_environment_that_will_not_open_is_moved_aside_loudly(tier, break_it):
    break_it(tier)
    result = damage.check_in_child(tier, PROMPTS)
    # the engine started, empty, and said so at ERROR; the evidence is kept beside
    assert (result["missed"], result["moved_aside"]) == (PROMPTS, 1)
    assert "ERROR" in result["log"] or "moved it to" in result["log"]
    aside = [name for name in os.listdir(tier) if name.startswith("lmdb.damaged-")]
    assert len(aside) == 1 and os.path.exists(os.path.join(tier, aside[0], "data.mdb"))


@pytest.mark.parametrize("seed", range(3))
def test_bits_flipped_under_lmdb_never_crash_and_never_serve_wrong_bytes(tier, seed):
    damage.flip_file(tier, np.random.default_rng(seed), count=40, start=2 * 4096)
    result = damage.check_in_child(tier, PROMPTS)
    assert "crashed" not in result and "failed" not in result, result
    assert result["wrong"] == 0


@pytest.mark.parametrize("fraction", [0.2, 0.6])
def test_a_file_cut_short_never_crashes_and_never_serves_wrong_bytes(tier, fraction):
    damage.cut_file(tier, fraction)
    result = damage.check_in_child(tier, PROMPTS)
    assert "crashed" not in result and "failed" not in result, result
    assert result["wrong"] == 0
