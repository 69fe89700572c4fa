"""`tiercache stats` against a real daemon: the table shows what was stored, matched and
loaded; --watch redraws with rates until Ctrl-C; --json answers scripts; the command
loads no torch."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from tests.service.daemon import ROOT, running_daemon
from tests.service.worker_process import LAYOUT, prompt
from tiercache.client import Client


def stats(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tiercache_service.cli", "stats", *args], cwd=ROOT,
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
        assert "(disk budget: 80% of the 256.0 MiB LMDB map;" in out  # why 204.8 MiB
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


def test_the_hit_rate_counts_loads_without_a_match_and_json_answers_without_torch(tmp_path):
    with running_daemon(tmp_path) as (address, _):
        worker = Client(address).register("test-model", LAYOUT)
        # 1. one prompt stored, then loaded with no Match before (as the transformers adapter
        # and the demo do), and a prompt nobody stored, loaded too
        worker.store(prompt(0), kv_rows=range(6), checkpoints={96: 0})
        assert worker.load(prompt(0), kv_rows=range(10, 16), slot=3).match.pages == 6
        assert worker.load(prompt(1), kv_rows=range(10, 16), slot=3).match.pages == 0
        # 2. the table counts the pages both loads asked for and the 6 the first found
        out, _ = stats("--address", address).communicate(timeout=60)
        assert ("hit rate    50.0%  (6 of 12 pages asked by 0 matches and 2 loads without a "
                "match)") in out
        # 3. --json, read in a process that checks what the command imported
        script = ("import sys; from tiercache_service.cli import main; code = main(sys.argv[1:]); "
                  "print('heavy:', sorted(m for m in ('torch', 'numpy', 'tiercache.engine') "
                  "if m in sys.modules)); sys.exit(code)")
        done = subprocess.run([sys.executable, "-c", script, "stats", "--address", address, "--json"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        answer, heavy = done.stdout.splitlines()
        assert heavy == "heavy: []"
        data = json.loads(answer)
        assert data["hit_rate"] == {"hit_pages": 6, "asked_pages": 12, "ratio": 0.5}
        assert data["workers"] == 1 and data["address"] == address
        assert data["tiers"][0] == {"tier": "host", "entries": 7, "used_bytes": 6 * LAYOUT.page_bytes
                                    + LAYOUT.checkpoint_bytes, "budget_bytes": 64 << 20}
        assert data["counters"]["lookups_load"] == 2 and data["counters"]["lookups_match"] == 0
        worker.close()
