"""Every RPC fuzzed with structure-aware random messages, short (the long run is
`python -m benchmarks.fuzz_rpc`, 100,000 inputs)."""

from __future__ import annotations

from drills import fuzz as fuzz_rpc


def test_random_messages_to_every_rpc_get_deliberate_statuses_only(tmp_path):
    outcome = fuzz_rpc.run(examples=1000, seed=1, folder=tmp_path)
    # no undeliberate status, no foreign byte in any loaded row, the books balanced
    # after every one of the calls
    assert outcome.failures == [] and outcome.foreign == 0
    assert outcome.invariant_checks == 1000
    # every RPC was exercised, some calls went through rather than all being refused,
    # and loads did deliver entries for the isolation oracle to check
    assert set(outcome.calls) == {*fuzz_rpc.METHODS, "lane"}
    assert outcome.codes["OK"] > 0 and len(outcome.codes) > 3 and outcome.loaded_entries > 0


def test_raw_bytes_to_a_daemon_never_take_it_down():
    codes, alive = fuzz_rpc.run_raw(messages=70, seed=1)
    assert alive and sum(codes.values()) == 70
    assert "UNKNOWN" not in codes
