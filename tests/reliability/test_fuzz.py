"""Every RPC fuzzed with structure-aware random messages, short (the long run is
`python -m benchmarks.fuzz_rpc`, 100,000 inputs)."""

from __future__ import annotations

from benchmarks import fuzz_rpc


def test_random_messages_to_every_rpc_get_deliberate_statuses_only(tmp_path):
    outcome = fuzz_rpc.run(examples=600, seed=1, folder=tmp_path)
    assert outcome.failures == []
    # every RPC was exercised, and some calls went through rather than all being refused
    assert set(outcome.calls) == set(fuzz_rpc.METHODS)
    assert outcome.codes["OK"] > 0 and len(outcome.codes) > 3


def test_raw_bytes_to_a_daemon_never_take_it_down():
    codes, alive = fuzz_rpc.run_raw(messages=70, seed=1)
    assert alive and sum(codes.values()) == 70
    assert "UNKNOWN" not in codes
