"""Crash safety, short: a few SIGKILLs of the daemon while workers store (the long run is
`python -m benchmarks.crash_loop`, 1,000 cycles)."""

from __future__ import annotations

import signal
import time

import pytest

from drills import crash as crash_loop
from drills import prompts
from tests.service.daemon import running_daemon
from tiercache.client import Client
from tiercache.errors import Unavailable


def test_acknowledged_durable_stores_survive_sigkill_and_nothing_else_shows(tmp_path):
    history = crash_loop.run(cycles=4, workers=2, seed=1, data_dir=tmp_path)
    counts = history.counts
    assert counts["cycles"] == 4
    # the workers got durable acknowledgements, and the checks had entries to look at
    assert counts["durable_acks"] > 0 and counts["entries_checked"] > 0
    assert counts["prompts_loaded"] > 0
    # none lost, none wrong, none out of nowhere; the environment always opened
    assert (counts["lost"], counts["wrong"], counts["unexpected"], counts["env_failures"]) == (0, 0, 0, 0)


def test_a_worker_can_tell_that_its_daemon_went_away(tmp_path):
    with running_daemon(tmp_path, "--no-disk") as (address, daemon):
        worker = Client(address).register(prompts.MODEL, prompts.LAYOUT)
        assert worker.connected
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        deadline = time.time() + 10
        while worker.connected and time.time() < deadline:
            time.sleep(0.05)
        # the registration stream broke: loads that replied before cannot be trusted
        assert not worker.connected
        with pytest.raises(Unavailable):
            worker.match(prompts.tokens(0))
