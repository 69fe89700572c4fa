"""A real daemon process on a temporary socket, for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def running_daemon(data_dir: Path, *flags: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `tiercache serve`, wait until it listens, stop it with SIGTERM at the end."""
    socket = data_dir / "tiercache.sock"
    command = [sys.executable, "-m", "service.cli", "serve", "--data-dir", str(data_dir),
               "--socket", str(socket), "--host-budget", "64MiB", "--disk-map-size", "256MiB",
               "--grace-seconds", "2", *flags]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    first = process.stdout.readline()
    if "listening" not in first:
        process.kill()
        raise RuntimeError(f"the daemon did not start: {first}{process.stdout.read()}")
    try:
        yield f"unix:{socket}", process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
