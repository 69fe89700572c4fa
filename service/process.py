"""The daemon as a child process, for the demo, the tests and the benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


@contextmanager
def spawn(data_dir: str | Path, *flags: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `tiercache serve` on a socket in `data_dir`, wait until it listens, yield its
    address; SIGTERM (orderly stop) at the end. What the daemon prints after its first line
    goes on to this process's stderr: left in the pipe, it would block the daemon once the
    pipe is full."""
    socket = Path(data_dir) / "tiercache.sock"
    command = [sys.executable, "-m", "service.cli", "serve", "--data-dir", str(data_dir),
               "--socket", str(socket), *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    first = process.stdout.readline()
    if "listening" not in first:
        process.kill()
        raise RuntimeError(f"the daemon did not start: {first}{process.stdout.read()}")
    forward = threading.Thread(target=_forward, args=(process.stdout,), daemon=True)
    forward.start()
    try:
        yield f"unix:{socket}", process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
        forward.join(timeout=5)  # its last lines out before the caller's stderr may go


def _forward(output: IO[str]) -> None:
    for line in output:
        sys.stderr.write(line)
