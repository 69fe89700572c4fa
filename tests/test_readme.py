"""The README's worker example runs as written, against a real daemon (on a temporary
socket instead of `make serve`'s)."""

from __future__ import annotations

import re
import subprocess
import sys

from tiercache_service.config import ServiceConfig
from tests.service.daemon import ROOT, running_daemon


def worker_example() -> str:
    """The first python block under "Using it from a worker"."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Using it from a worker"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_worker_example_stores_a_prompt_and_the_next_run_finds_it(tmp_path):
    code = worker_example()
    # it names the socket `make serve` listens on ...
    served = f'"unix:{ServiceConfig().socket_path}"'
    assert served in code
    with running_daemon(tmp_path) as (address, _):
        # ... which here is a temporary daemon's
        runnable = code.replace(served, repr(address))

        def run() -> str:
            ran = subprocess.run([sys.executable, "-c", runnable], cwd=ROOT,
                                 capture_output=True, text=True, timeout=120)
            assert ran.returncode == 0, ran.stderr
            return ran.stdout.strip()

        # the first run stores the prompt; the next loads its 6 full pages and the state
        # after them
        assert run() == "0 of 100 tokens cached"
        assert run() == "96 of 100 tokens cached"
