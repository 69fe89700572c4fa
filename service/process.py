"""The daemon as a child process, for the demo, the tests and the benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def spawn(data_dir: str | Path, *flags: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `tiercache serve` on a socket in `data_dir`, wait until it listens, yield its
    address; SIGTERM (orderly stop) at the end. Metrics go to a free port (several
    daemons may run at once); `process.startup_line` is the line that says where."""
    socket = Path(data_dir) / "tiercache.sock"
    command = [sys.executable, "-m", "service.cli", "serve", "--data-dir", str(data_dir),
               "--socket", str(socket), "--metrics-address", "127.0.0.1:0", *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    first = process.stdout.readline()
    if "listening" not in first:
        process.kill()
        raise RuntimeError(f"the daemon did not start: {first}{process.stdout.read()}")
    process.startup_line = first  # type: ignore[attr-defined]
    try:
        yield f"unix:{socket}", process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
