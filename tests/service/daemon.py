"""A real daemon on a temporary socket, with small budgets, for tests.

Tests run beside `make serve`: every daemon they start takes its socket and data under a
temporary directory and its metrics on a free port (never the defaults, ./tiercache-data
and 9477). Start daemons here or with service.process.spawn; tests/service/test_ports.py
keeps the rule."""

from __future__ import annotations

import os
import re
import shutil
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tiercache_service.config import ServiceConfig
from tiercache_service.process import spawn
from tiercache_service.server import Daemon, start

ROOT = Path(__file__).resolve().parents[2]
# promtool comes with Debian's prometheus package, which .ci/run installs: CI never skips
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None and not os.environ.get("CI"),
    reason="promtool is not installed here (apt-get install prometheus; .ci/run does)")


@contextmanager
def running_daemon(data_dir: Path, *flags: str) -> Iterator:
    with spawn(data_dir, "--host-budget", "64MiB", "--disk-map-size", "256MiB",
               "--grace-seconds", "2", *flags) as daemon:
        yield daemon


@contextmanager
def daemon_in_this_process(data_dir: Path, **settings) -> Iterator[Daemon]:
    """The daemon in the test's own process (for tests that change what it runs, e.g. a
    narrowed hash), its socket in `data_dir`, its metrics on a free port."""
    config = ServiceConfig(**{"data_dir": str(data_dir), "metrics_address": "127.0.0.1:0",
                              "grace_seconds": 1.0, **settings}).check()
    served = start(config)
    try:
        yield served
    finally:
        served.stop()


def metrics_url(process) -> str:
    """Where the daemon serves metrics, from the line it printed when it began listening."""
    found = re.search(r"http://[^\s\"';]+/metrics", process.startup_line)
    assert found, f"no metrics address in {process.startup_line!r}"
    return found.group(0)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()
