"""Crash safety, short: a few SIGKILLs of the daemon while workers store (the long run is
`python -m benchmarks.crash_loop`, 1,000 cycles)."""

from __future__ import annotations

from benchmarks import crash_loop


def test_acknowledged_durable_stores_survive_sigkill_and_nothing_else_shows(tmp_path):
    history = crash_loop.run(cycles=4, workers=2, seed=1, data_dir=tmp_path)
    counts = history.counts
    assert counts["cycles"] == 4
    # the workers got durable acknowledgements, and the checks had entries to look at
    assert counts["durable_acks"] > 0 and counts["entries_checked"] > 0
    assert counts["prompts_loaded"] > 0
    # none lost, none wrong, none out of nowhere; the environment always opened
    assert (counts["lost"], counts["wrong"], counts["unexpected"], counts["env_failures"]) == (0, 0, 0, 0)
