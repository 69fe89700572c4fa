"""A real daemon process on a temporary socket, with small budgets, for tests."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from service.process import spawn

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def running_daemon(data_dir: Path, *flags: str) -> Iterator:
    with spawn(data_dir, "--host-budget", "64MiB", "--disk-map-size", "256MiB",
               "--grace-seconds", "2", *flags) as daemon:
        yield daemon
