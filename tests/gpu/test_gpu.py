"""The GPU data path end to end: a daemon process, workers in their own processes with
CUDA buffers shared by IPC. Runs only where there is a GPU (make test-gpu)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.gpu.gpu_worker import PAGES, layout, prompt
from tests.service.daemon import ROOT, running_daemon
from tiercache.client import Client

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.gpu.gpu_worker", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> str:
    out, _ = process.communicate(timeout=300)
    return out.strip().splitlines()[-1] if out.strip() else out


@pytest.mark.parametrize("row_bytes, buffers", [(2048, 64), (16384, 24), (262144, 8), (2 << 20, 1)])
def test_bytes_round_trip_through_device_host_and_disk(tmp_path, row_bytes, buffers):
    # tiers too small for all six prompts: the newest stay on the device, older ones go
    # down to the host, the oldest to disk, and every one comes back exact
    prompts, prompt_bytes = 6, 8 * row_bytes * buffers + row_bytes
    flags = ["--device-budget", str(2 * prompt_bytes), "--host-budget", str(3 * prompt_bytes),
             "--disk-map-size", "4GiB"]
    with running_daemon(tmp_path, *flags) as (address, _):
        out = finish(worker("roundtrip", address, "1", str(row_bytes), str(buffers), str(prompts)))
        assert out.startswith("ok"), out
        assert {"DEVICE", "HOST", "DISK"} <= set(out.split()), out


def test_the_worker_stream_reads_the_load_without_a_host_sync(tmp_path):
    with running_daemon(tmp_path, "--host-budget", "2GiB", "--no-disk") as (address, _):
        assert finish(worker("stream", address, "2")) == "ok"


def test_stores_right_behind_their_writes_copy_the_written_bytes_every_time(tmp_path):
    with running_daemon(tmp_path, "--host-budget", "1GiB", "--no-disk") as (address, _):
        assert finish(worker("ordered", address, "5")) == "ok"


@pytest.mark.parametrize("tier", ["host", "device"])
def test_rows_written_right_after_a_stores_reply_do_not_reach_its_entries(tmp_path, tier):
    flags = ["--device-budget", "1GiB"] if tier == "device" else []
    with running_daemon(tmp_path, "--host-budget", "2GiB", "--no-disk", *flags) as (address, _):
        assert finish(worker("reuse", address, "6")) == "ok"


@pytest.mark.parametrize("tier", ["host", "device"])
def test_rows_written_right_after_a_post_do_not_reach_its_entries(tmp_path, tier):
    flags = ["--device-budget", "1GiB"] if tier == "device" else []
    with running_daemon(tmp_path, "--host-budget", "2GiB", "--no-disk", *flags) as (address, _):
        assert finish(worker("posted", address, "9")) == "ok"


@pytest.mark.parametrize("tier", ["host", "device"])
def test_a_posted_load_is_read_in_stream_order_before_its_reply_is_waited_for(tmp_path, tier):
    flags = ["--device-budget", "1GiB"] if tier == "device" else []
    with running_daemon(tmp_path, "--host-budget", "2GiB", "--no-disk", *flags) as (address, _):
        assert finish(worker("post_load", address, "10")) == "ok"


@pytest.mark.parametrize("tier", ["host", "device"])
def test_a_fresh_daemons_first_store_and_load_do_not_wait_for_the_workers_gpu_work(tmp_path, tier):
    # the copy kernels are loaded when the worker registers: loading one at the first
    # store or load waited for the worker's work queued before the call (seconds here)
    flags = ["--device-budget", "1GiB"] if tier == "device" else []
    with running_daemon(tmp_path, "--host-budget", "1GiB", "--no-disk", *flags) as (address, _):
        assert finish(worker("behind", address, "7")) == "ok"


@pytest.mark.parametrize("tier", ["host", "device"])
def test_calls_that_copy_nothing_leave_the_workers_stream_free(tmp_path, tier):
    # the daemon writes a call's done word whatever the call did; a call it never saw is
    # settled (a load the client refused after taking its signal)
    flags = ["--device-budget", "1GiB"] if tier == "device" else []
    with running_daemon(tmp_path, "--host-budget", "1GiB", "--no-disk", *flags) as (address, _):
        assert finish(worker("unanswered", address, "8")) == "ok"


def test_a_store_behind_one_tenants_gpu_work_holds_back_that_tenants_calls_only(tmp_path):
    # a store replies with its copies queued behind the worker's GPU work, and every call
    # that begins after the reply sees its entries: every call of its tenant waits for
    # them, and none of another tenant's (which cannot see them)
    (tmp_path / "tenants.toml").write_text('[tenants.acme]\ntokens = ["acme-token"]\n'
                                           '[tenants.beta]\ntokens = ["beta-token"]\n')
    (tmp_path / "tenants.toml").chmod(0o600)
    with running_daemon(tmp_path / "data", "--tenants-file", str(tmp_path / "tenants.toml"),
                        "--host-budget", "1GiB", "--no-disk") as (address, _):
        beta_client = Client(address, token="beta-token")
        beta = beta_client.register("cpu", layout(4096, 2, rows=16))
        beta.store(prompt(5), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0})
        acme = Client(address, token="acme-token").register("cpu", layout(4096, 2, rows=16))
        slow = subprocess.Popen([sys.executable, "-m", "tests.gpu.gpu_worker", "slow", address, "9"],
                                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "TIERCACHE_TOKEN": "acme-token"})
        assert slow.stdout.readline().strip() == "replied"
        started = time.monotonic()
        assert beta.match(prompt(5)).pages == PAGES
        beta_client.stats()
        others = time.monotonic() - started
        assert acme.match(prompt(5)).pages == 0
        own = time.monotonic() - started
        slow.communicate("end\n", timeout=60)
        assert others < 2 < own, (others, own)  # the 6 s of GPU work: acme's calls only


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_workers_on_two_gpus_read_each_others_entries_exactly(tmp_path):
    # the device tier goes to the first worker's GPU (the second here); the other GPU's
    # worker reads from host copies, even right after the stores, before they go down
    with running_daemon(tmp_path, "--device-budget", "1GiB", "--host-budget", "1GiB",
                        "--no-disk") as (address, _):
        out = finish(worker("two_gpus", address, "12"))
        assert out.startswith("ok"), out


def test_a_killed_worker_is_unmapped_and_others_are_served(tmp_path):
    with running_daemon(tmp_path, "--host-budget", "1GiB", "--no-disk") as (address, daemon):
        holder = worker("hold", address, "3")
        assert holder.stdout.readline().strip() == "stored"
        client = Client(address)
        assert client.stats().workers == 1 and client.stats().counters["ipc_allocations"] >= 1
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        deadline = time.time() + 30  # the daemon notices the stream break
        while (client.stats().workers or client.stats().counters["ipc_allocations"]) and time.time() < deadline:
            time.sleep(0.2)  # its allocations close after the registration went
        assert client.stats().workers == 0 and client.stats().counters["ipc_allocations"] == 0
        assert finish(worker("roundtrip", address, "4", "16384", "4", "2")).startswith("ok")
        assert daemon.poll() is None
