"""`tiercache stats` against a real daemon: the table shows what was stored and matched;
--watch redraws with rates until Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.service.daemon import ROOT, running_daemon
from tests.service.worker_process import LAYOUT, prompt
from tiercache.client import Client


def stats(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "service.cli", "stats", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_stats_shows_tiers_hit_rate_and_counters_and_watch_redraws(tmp_path):
    with running_daemon(tmp_path) as (address, _):
        worker = Client(address).register("test-model", LAYOUT)
        # 1. one prompt stored (6 pages + a checkpoint), matched once in full and once
        # as a prompt nobody stored
        worker.store(prompt(0), kv_rows=range(6), checkpoints={96: 0})
        assert worker.match(prompt(0)).pages == 6 and worker.match(prompt(1)).pages == 0
        # 2. the table, while the worker is still registered
        out, _ = stats("--address", address).communicate(timeout=60)
        rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
        assert rows["host"][1:5] == ["7", f"{(6 * LAYOUT.page_bytes + LAYOUT.checkpoint_bytes) / 1024:.1f}",
                                     "KiB", "64.0"]
        assert rows["disk"][1] == "0"
        assert "workers 1" in out
        assert ("hit rate    50.0%  (6 of 12 pages asked by 2 matches and 0 loads without a "
                "match)") in out
        assert "pages 6  checkpoints 1" in out and "worker->host" in out
        # 3. --watch draws again and again, with rates, until Ctrl-C ends it cleanly
        watching = stats("--address", address, "--watch", "0.2")
        frames = [watching.stdout.readline() for _ in range(40)]
        watching.send_signal(signal.SIGINT)
        rest, _ = watching.communicate(timeout=30)
        shown = "".join(frames) + rest
        assert shown.count("\x1b[H\x1b[2J") >= 2 and "per second  matches 0.0" in shown
        assert watching.returncode == 0
        worker.close()


def test_stats_says_clearly_when_no_daemon_answers(tmp_path):
    out, _ = stats("--address", f"unix:{tmp_path}/none.sock", "--timeout", "2").communicate(timeout=60)
    assert out.startswith(f"tiercache stats: cannot read the daemon at unix:{tmp_path}/none.sock")
