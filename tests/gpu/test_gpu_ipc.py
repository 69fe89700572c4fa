"""The red team's buffer questions, asked of CUDA IPC buffers on a GPU (make test-gpu):
an allocation another tenant's worker registered, an allocation freed while the daemon
holds it open, and entries of another layout in the device tier.

Workers run in processes of their own (tests/gpu/ipc_worker.py), as real ones do.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.service.daemon import ROOT, running_daemon
from tiercache.client import Client

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
TENANTS = '[tenants.acme]\ntokens = ["acme-token"]\n[tenants.beta]\ntokens = ["beta-token"]\n'


def worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.gpu.ipc_worker", *args], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def said(process: subprocess.Popen, word: str) -> str:
    while True:
        line = process.stdout.readline()
        assert line, f"the worker ended before {word!r}"
        if line.startswith(word):
            return line.split(" ", 1)[1].strip() if " " in line.strip() else ""


@pytest.fixture
def daemon(tmp_path):
    (tmp_path / "tenants.toml").write_text(TENANTS)
    (tmp_path / "tenants.toml").chmod(0o600)
    with running_daemon(tmp_path / "data", "--no-disk", "--host-budget", "256MiB",
                        "--device-budget", "256MiB", "--tenants-file",
                        str(tmp_path / "tenants.toml")) as (address, process):
        yield address, process


def test_another_tenants_allocation_cannot_be_registered(daemon):
    address, process = daemon
    owner = worker("export", address, "acme-token")
    handles = said(owner, "handles")  # what a thief would need: the handle bytes
    thief = subprocess.run([sys.executable, "-m", "tests.gpu.ipc_worker", "steal", address,
                            "beta-token", handles], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert thief.stdout.strip().endswith("refused PERMISSION_DENIED"), thief.stdout + thief.stderr
    owner.communicate("done\n", timeout=120)
    assert process.poll() is None


def test_an_allocation_freed_while_registered_never_takes_the_daemon_down(daemon):
    address, process = daemon
    freed = subprocess.run([sys.executable, "-m", "tests.gpu.ipc_worker", "free", address,
                            "acme-token"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "calls done" in freed.stdout, freed.stdout + freed.stderr
    # the daemon lives and serves the next worker exactly
    again = subprocess.run([sys.executable, "-m", "tests.gpu.ipc_worker", "layouts", address,
                            "acme-token"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.stdout.strip().endswith("ok"), again.stdout + again.stderr
    assert process.poll() is None and Client(address, token="acme-token").stats() is not None


def test_device_tier_entries_of_another_layout_are_misses(daemon):
    address, process = daemon
    run = subprocess.run([sys.executable, "-m", "tests.gpu.ipc_worker", "layouts", address,
                          "acme-token"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.stdout.strip().endswith("ok"), run.stdout + run.stderr
