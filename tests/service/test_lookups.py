"""Lookups as the servicer counts them (service.lookups): a Load after its Match is told
apart from a Load on its own, so the hit rate asks each prompt once, and model labels stay
bounded however many model ids workers bring."""

from __future__ import annotations

from tiercache_service.lookups import OTHER_MODEL, Lookups, hit_rate


def keys(*pages: int) -> bytes:
    """Wire keys, 16 bytes each, one per page number."""
    return b"".join(page.to_bytes(16, "little") for page in pages)


def test_a_load_after_its_match_is_not_asked_twice():
    lookups = Lookups()
    prompt = keys(1, 2, 3, 4, 5, 6)
    # 1. a Match of 6 pages finds 4; the worker then loads the 4 (rows for 4)
    lookups.matched("m", prompt, 6, 4)
    lookups.loaded("m", prompt, 4, 4)
    # 2. vLLM's ranks load the tail beyond their own hit (pages 3..4): a follow-up too
    lookups.loaded("m", keys(3, 4), 2, 2)
    # 3. the adapter loads another prompt with rows for all of it, no Match before
    lookups.loaded("m", keys(7, 8, 9), 3, 1)
    counted = lookups.flat()
    assert (counted["lookups_match"], counted["lookups_load_after_match"],
            counted["lookups_load"]) == (1, 2, 1)
    assert (counted["lookup_pages_load_after_match"], counted["lookup_hit_pages_load_after_match"]
            ) == (6, 6)
    # 4. the hit rate: 4 of the Match's 6, and 1 of the direct load's 3
    assert hit_rate(counted) == (5, 9)


def test_a_match_that_found_nothing_makes_no_later_load_a_follow_up():
    lookups = Lookups()
    lookups.matched("m", keys(1, 2), 2, 0)
    lookups.loaded("m", keys(1, 2), 2, 0)
    assert lookups.flat()["lookups_load"] == 1


def test_model_labels_are_bounded():
    lookups = Lookups(max_models=3)
    # 1. five models look up a prompt each: the first three get labels, the rest "other"
    for n in range(5):
        lookups.matched(f"model-{n}", keys(n), 1, 1)
    assert {model for _, model in lookups.snapshot()} == {"model-0", "model-1", "model-2",
                                                          OTHER_MODEL}
    # 2. a labelled model keeps its label; one more new model is "other" too
    assert lookups.model_label("model-1") == "model-1"
    assert lookups.model_label("model-9") == OTHER_MODEL
    assert lookups.snapshot()[("match", OTHER_MODEL)] == (2, 2, 2)
