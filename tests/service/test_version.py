"""One version, written once (tiercache.__version__), and everywhere an operator looks:
the package's metadata, `tiercache --version`, the daemon's startup line and the
`tiercache_build_info` gauge on /metrics."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from prometheus_client.parser import text_string_to_metric_families

from tests.service.daemon import ROOT, metrics_url, running_daemon, scrape
from tiercache import __version__


def test_the_version_is_a_release_number_the_package_reads_from_one_place():
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", __version__), __version__
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # pyproject.toml writes no number of its own: setuptools takes tiercache.__version__
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tiercache.__version__"}


def test_the_license_is_the_one_pyproject_names():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_command_line_prints_its_version():
    done = subprocess.run([sys.executable, "-m", "tiercache_service.cli", "--version"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"tiercache {__version__}\n", "")


def test_the_daemon_says_its_version_when_it_starts_and_on_metrics(tmp_path):
    with running_daemon(tmp_path) as (_, process):
        # 1. the startup line names it
        assert f"tiercache {__version__} listening on unix:" in process.startup_line
        # 2. /metrics has tiercache_build_info{version=...} 1, and only that one series
        families = {f.name: f for f in text_string_to_metric_families(scrape(metrics_url(process)))}
        build = families["tiercache_build_info"]
        assert build.type == "gauge"
        assert [(s.labels, s.value) for s in build.samples] == [({"version": __version__}, 1.0)]
