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
def spawn(data_dir: str | Path, *flags: str,
          forward_output: bool = False) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `tiercache serve` on a socket in `data_dir`, wait until it listens, yield its
    address; SIGTERM (orderly stop) at the end. Metrics go to a free port (several
    daemons may run at once); `process.startup_line` is the line that says where, and
    `process.warnings` what the daemon said before it (warnings, the rebuild of the index).
    What the daemon prints after that stays in its pipe for the caller to read, or, with
    `forward_output`, goes on to this process's stderr: a long run must take it, since a
    daemon whose pipe is full blocks on its next log line."""
    socket = Path(data_dir) / "tiercache.sock"
    command = [sys.executable, "-m", "tiercache_service.cli", "serve", "--data-dir", str(data_dir),
               "--socket", str(socket), "--metrics-address", "127.0.0.1:0", *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    said = [process.stdout.readline()]
    while said[-1] and "listening" not in said[-1]:  # warnings may come first
        said.append(process.stdout.readline())
    if "listening" not in said[-1]:
        process.kill()
        raise RuntimeError(f"the daemon did not start: {''.join(said)}{process.stdout.read()}")
    process.startup_line = said[-1]  # type: ignore[attr-defined]
    process.warnings = said[:-1]  # type: ignore[attr-defined]  # what it said before that
    forward = threading.Thread(target=_forward, args=(process.stdout,), daemon=True)
    if forward_output:
        forward.start()
    try:
        yield f"unix:{socket}", process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
        if forward_output:
            forward.join(timeout=5)  # its last lines out before the caller's stderr may go


def _forward(output: IO[str]) -> None:
    for line in output:
        sys.stderr.write(line)
