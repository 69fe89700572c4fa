"""Tests run beside `make serve` (README: one shell serves, the other tests): no daemon
they start takes the default metrics port 9477 or the default ./tiercache-data."""

from __future__ import annotations

import ast
import errno
import socket
from pathlib import Path

from tests.service.daemon import ROOT, daemon_in_this_process, metrics_url, running_daemon

DEFAULT_METRICS = ("127.0.0.1", 9477)
# where daemons are started from: the tests, the drills and benchmarks they share, the demo
SOURCES = ("tests", "drills", "benchmarks", "examples", "service/process.py")
IN_PROCESS_HELPER = ROOT / "tests" / "service" / "daemon.py"


def hold_default_metrics_port() -> socket.socket | None:
    """Take 127.0.0.1:9477 as `make serve` would; None if something already holds it."""
    held = socket.socket()
    try:
        held.bind(DEFAULT_METRICS)
    except OSError as error:
        held.close()
        assert error.errno == errno.EADDRINUSE, error
        return None
    held.listen()
    return held


def test_daemons_of_the_test_helpers_start_while_the_default_port_is_taken(tmp_path):
    held = hold_default_metrics_port()
    try:
        # a daemon process (service.process.spawn), as most tests start one
        with running_daemon(tmp_path / "process") as (address, process):
            assert address == f"unix:{tmp_path / 'process' / 'tiercache.sock'}"
            assert not metrics_url(process).startswith("http://127.0.0.1:9477/")
        # a daemon in this process, as tests that patch it start one
        with daemon_in_this_process(tmp_path / "here") as served:
            assert served.addresses == [f"unix:{tmp_path / 'here' / 'tiercache.sock'}"]
            assert served.endpoints.metrics_url
            assert not served.endpoints.metrics_url.startswith("http://127.0.0.1:9477/")
    finally:
        if held is not None:
            held.close()


def sources() -> list[Path]:
    found = []
    for name in SOURCES:
        path = ROOT / name
        found += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return found


def test_every_daemon_started_from_tests_or_drills_names_its_data_dir_and_a_free_port():
    """The class of the bug, not one test: a command line `... serve` must name its data
    directory and a metrics address that is off or port 0; the in-process `start` is
    called only by the helper, which does the same."""
    wrong = []
    for path in sources():
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        compared = {id(n) for c in ast.walk(tree) if isinstance(c, ast.Compare)
                    for n in (c.left, *c.comparators)}  # a command checked, not started
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and node.module == "tiercache_service.server"
                    and any(a.name == "start" for a in node.names) and path != IN_PROCESS_HELPER):
                wrong.append(f"{where}:{node.lineno}: starts a daemon in-process: use "
                             "tests.service.daemon.daemon_in_this_process")
            if isinstance(node, ast.List) and id(node) not in compared:
                words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
                if "serve" not in words or not {"tiercache_service.cli", "tiercache"} & set(words):
                    continue
                if {"--help", "-h", "--version"} & set(words):  # prints, starts nothing
                    continue
                metrics = (words[words.index("--metrics-address") + 1]
                           if "--metrics-address" in words[:-1] else None)
                if "--data-dir" not in words or not isinstance(metrics, str) or (
                        metrics and not metrics.endswith(":0")):
                    wrong.append(f"{where}:{node.lineno}: `serve` without --data-dir and "
                                 "--metrics-address HOST:0 (or '')")
    assert not wrong, "\n".join(wrong)
