"""A real daemon process on a temporary socket, with small budgets, for tests."""

from __future__ import annotations

import os
import re
import shutil
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from service.process import spawn

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


def metrics_url(process) -> str:
    """Where the daemon serves metrics, from the line it printed when it began listening."""
    found = re.search(r"http://[^\s\"';]+/metrics", process.startup_line)
    assert found, f"no metrics address in {process.startup_line!r}"
    return found.group(0)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()
