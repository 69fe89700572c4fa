"""The daemon as users run it: a real process on a real socket, workers in other
processes sharing their buffers through POSIX shared memory."""

from __future__ import annotations

import signal
import subprocess
import sys


from tests.service.daemon import ROOT, running_daemon
from tiercache.client import Client


def worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.service.worker_process", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_worker_loads_what_another_process_stored_and_survives_its_death(tmp_path):
    with running_daemon(tmp_path) as (address, _):
        # worker A stores 8 prompts from its shared memory, then holds its registration open
        a = worker("store", address, "7", "8", "--hold")
        lines = [a.stdout.readline().strip() for _ in range(8)]
        assert lines == [f"stored {n}" for n in range(8)], lines + [a.stdout.read()]
        assert Client(address).stats().workers == 1
        # A dies without a word: the daemon drops its registration and keeps A's bytes
        a.send_signal(signal.SIGKILL)
        a.wait()
        # worker B, other rows and slots, loads all 8 prompts: every byte as A had it
        b = worker("load", address, "7", "8")
        out, _ = b.communicate(timeout=60)
        assert out.split("\n")[:8] == [f"ok {n}" for n in range(8)], out
        assert b.returncode == 0
        stats = Client(address).stats()
        assert stats.workers == 0 and stats.counters["loaded_pages"] == 48


def test_a_worker_killed_half_way_through_its_stores_leaves_the_daemon_serving(tmp_path):
    with running_daemon(tmp_path) as (address, daemon):
        a = worker("store", address, "3", "400")
        for _ in range(5):
            assert a.stdout.readline().startswith("stored")
        a.send_signal(signal.SIGKILL)  # in the middle of its stream of stores
        a.wait()
        b = worker("load", address, "3", "5")
        out, _ = b.communicate(timeout=60)
        assert out.split("\n")[:5] == [f"ok {n}" for n in range(5)], out
        assert daemon.poll() is None


def test_disk_entries_hit_after_the_daemon_restarts(tmp_path):
    with running_daemon(tmp_path) as (address, _):
        a = worker("store", address, "11", "4")
        assert a.communicate(timeout=60)[0].split("\n")[:4] == [f"stored {n}" for n in range(4)]
    # SIGTERM flushed the host tier to LMDB; a new daemon on the same directory serves it
    with running_daemon(tmp_path) as (address, _):
        disk = [t for t in Client(address).stats().tiers if t.tier.name == "DISK"][0]
        assert disk.entries == 4 * 7
        b = worker("load", address, "11", "4")
        out, _ = b.communicate(timeout=60)
        assert out.split("\n")[:4] == [f"ok {n}" for n in range(4)], out
