"""Sustained load, short: worker processes doing mixed match / load / store against tiny
budgets (the long run is `python -m benchmarks.soak`, 8 workers for 10 minutes)."""

from __future__ import annotations

from drills import soak


def test_mixed_load_on_tiny_budgets_has_no_errors_and_every_loaded_byte_is_right():
    result = soak.run(workers=3, seconds=8, sample_every=1.0)
    assert result.exits == [0, 0, 0]
    assert result.errors == 0 and result.counts["wrong"] == 0
    # the budgets were small enough that both tiers evicted, and loads did hit
    assert result.counters["evicted_host"] > 0 and result.counts["loaded_pages"] > 0
