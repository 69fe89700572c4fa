"""A daemon that is down, dies, stalls or comes back: vLLM's real scheduler goes on without
the cache, within the lookup budget, and never on a wrong byte (see test_scheduler)."""

from __future__ import annotations

import signal
import time

import pytest

pytest.importorskip("vllm")

from tests.service.daemon import running_daemon  # noqa: E402
from tests.tiercache.integrations.vllm.harness import engine, prompt, vllm_config  # noqa: E402
from tiercache.client import Client  # noqa: E402
from tiercache.errors import TiercacheError  # noqa: E402

BUDGET = 0.5  # seconds a lookup may take here: match_timeout 0.05 s, with room for CI


def test_a_daemon_that_is_not_there_costs_nothing_but_the_cache(tmp_path, hits):
    address = f"unix:{tmp_path / 'nobody-listens.sock'}"
    (tmp_path / "regions").mkdir()
    run = engine(vllm_config(tmp_path, address, retry_after=0.2), 64, Client(address))
    for n in range(4):
        run.add(f"r{n}", prompt(30, 87), max_tokens=3)  # the same prompt four times
    run.run()
    assert run.finished == {f"r{n}": "length" for n in range(4)}
    assert run.mismatches == []
    assert hits and all(n == 0 and seconds < BUDGET for _, _, n, seconds in hits)
    run.close()


def test_a_daemon_that_dies_and_comes_back(tmp_path, hits):
    data = tmp_path / "data"
    tokens = prompt(31, 87)
    with running_daemon(data) as (address, daemon):
        run = engine(vllm_config(tmp_path, address, retry_after=0.2, timeout=5), 64,
                     Client(address))
        run.add("a", tokens)
        run.run()
        # the daemon dies without a word, with a's pages and state in its memory
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        assert run.scheduler.reset_prefix_cache()
        run.add("b", tokens)
        run.run()  # lookups fail fast, saves fail, b computes everything itself
        assert run.starts["b"][0] == 0
    assert all(seconds < BUDGET for _, _, _, seconds in hits)
    # a new daemon on the same socket: the workers register again at their next step, the
    # scheduler looks again after retry_after; then saves and hits resume
    with running_daemon(data) as (address, _):
        run.add("c", tokens)
        while not complete(address, run.scheduler.connector.group_id):
            run.step()  # workers register again at a step, once gRPC reconnects (< 1 s)
            assert run.steps < 500
            time.sleep(0.05)
        run.run()
        time.sleep(0.3)  # past retry_after: the scheduler looks again
        for req_id in "de":  # d stores, e hits
            assert run.scheduler.reset_prefix_cache()
            run.add(req_id, tokens)
            run.run()
        assert run.starts["e"][0] == 80
        assert run.mismatches == []
        assert run.finished == {r: "length" for r in "abcde"}
        run.close()


def test_a_stalled_daemon_costs_one_lookup_budget_then_none(tmp_path, hits):
    with running_daemon(tmp_path / "data") as (address, daemon):
        run = engine(vllm_config(tmp_path, address, retry_after=30, timeout=1), 64,
                     Client(address))
        daemon.send_signal(signal.SIGSTOP)  # alive, listening, answering nothing
        try:
            for n in range(3):
                run.add(f"r{n}", prompt(40 + n, 87), max_tokens=2)
            began = time.monotonic()
            while run.scheduler.has_requests():
                run.step(drain_saves=False)  # saves wait on their thread, not the step
            assert time.monotonic() - began < 10
        finally:
            daemon.send_signal(signal.SIGCONT)
        lookups = [seconds for _, _, _, seconds in hits]
        # the first lookup waits out match_timeout; the breaker skips the daemon after
        assert len(lookups) >= 3 and lookups[0] < BUDGET and max(lookups[1:]) < 0.01
        assert run.mismatches == [] and len(run.finished) == 3
        run.close()


def complete(address: str, group_id: str) -> bool:
    try:
        return Client(address).group(group_id).complete
    except TiercacheError:  # not reconnected, or no rank back yet
        return False
