"""Settings: declared once (service.config.SETTINGS) with help, default and unit; read
from a TOML file, TIERCACHE_* variables and flags, in that order; refused in one line
that names the file, variable or flag, the setting and what to write (exit 2); and
TIERCACHE_* variables that are not settings (Kubernetes' service links) left alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache_service.config import SERVICE_LINK, SETTINGS, ServiceConfig, load, markdown_table, parse_bytes
from tiercache_service.settings import BYTES
from tests.service.daemon import ROOT, running_daemon
from tiercache.errors import InvalidArgument


@pytest.mark.parametrize("text, expected", [(4096, 4096), ("4096", 4096), ("1KiB", 1024),
                                            ("1.5 GiB", 3 << 29), ("2gb", 2_000_000_000)])
def test_sizes_read_with_units(text, expected):
    assert parse_bytes(text) == expected


def test_bad_sizes_say_how_to_write_them():
    with pytest.raises(InvalidArgument, match="4GiB"):
        parse_bytes("lots")


def test_file_then_environment_then_flags(tmp_path):
    path = tmp_path / "tiercache.toml"
    path.write_text('host_budget = "2GiB"\nmax_workers = 3\ndisk = false\n')
    # the file sets three values
    config = load(str(path), environ={})
    assert (config.host_budget, config.max_workers, config.disk) == (2 << 30, 3, False)
    # the environment overrides the file
    config = load(str(path), environ={"TIERCACHE_MAX_WORKERS": "5", "TIERCACHE_DISK": "true"})
    assert (config.max_workers, config.disk) == (5, True)
    # a flag overrides both; unset flags (None) do not
    config = load(str(path), environ={"TIERCACHE_MAX_WORKERS": "5"},
                  flags={"max_workers": "7", "host_budget": None})
    assert (config.max_workers, config.host_budget) == (7, 2 << 30)


def test_defaults_suit_a_laptop_and_put_everything_under_the_data_dir():
    config = load(environ={})
    assert config == ServiceConfig()
    assert config.socket_path == "./tiercache-data/tiercache.sock"
    assert config.engine().disk.path == "./tiercache-data/lmdb"


@pytest.mark.parametrize("source, message", [
    ({"flags": {"max_workers": "many"}}, "--max-workers 'many' is not a whole number"),
    ({"flags": {"host_budget": "0"}}, "host_budget must be positive"),
    ({"environ": {"TIERCACHE_DISK": "maybe"}}, "TIERCACHE_DISK='maybe' is not true or false"),
    ({"flags": {"policy": "random"}}, "policy must be one of lru, flop: write e.g. --policy lru"),
    ({"flags": {"remote": "redis-cluster://127.0.0.1:7000", "remote_writes": "later"}},
     "remote_writes must be one of through, evict"),
])
def test_bad_settings_name_the_setting(source, message):
    with pytest.raises(InvalidArgument, match=message):
        load(environ=source.get("environ", {}), flags=source.get("flags"))


@pytest.mark.parametrize("line, message", [
    ("max_workers = true", "max_workers = true is a boolean, not a whole number (workers): "
                           "write e.g. max_workers = 32"),
    ("max_workers = 2.5", "max_workers = 2.5 is a number, not a whole number (workers): "
                          "write e.g. max_workers = 32"),
    ("disk = 1", "disk = 1 is a whole number, not true or false: write e.g. disk = true"),
    ("host_budget = [1]", "host_budget = [1] is a list, not a size (bytes: 4GiB, 512MiB or "
                          '1048576): write e.g. host_budget = "1GiB"'),
    ("data_dir = 5", 'data_dir = 5 is a whole number, not text: write e.g. '
                     'data_dir = "./tiercache-data"'),
    ("policy = 'random'", 'policy = "random": policy must be one of lru, flop: write e.g. '
                          'policy = "lru"'),
    ("host_budgt = 5", "host_budgt is not a setting (did you mean host_budget?): "
                       "tiercache serve --help lists them"),
])
def test_a_file_value_of_the_wrong_kind_names_the_file_and_the_setting(tmp_path, line, message):
    path = tmp_path / "tiercache.toml"
    path.write_text(line + "\n")
    with pytest.raises(InvalidArgument) as refused:
        load(str(path), environ={})
    assert str(refused.value) == f"{path}: {message}"


def test_words_and_numbers_read_as_people_write_them(tmp_path):
    path = tmp_path / "tiercache.toml"
    path.write_text('grace_seconds = 3\nmax_workers = "4"\n')
    # a whole number where seconds go, a number in quotes, a choice in capitals
    config = load(str(path), environ={"TIERCACHE_LOG_LEVEL": "INFO", "TIERCACHE_POLICY": "FLOP"})
    assert (config.grace_seconds, config.max_workers, config.log_level, config.policy) == (
        3.0, 4, "info", "flop")


def test_every_setting_is_declared_with_help_a_default_and_a_unit():
    for s in SETTINGS:
        assert s.help and "\n" not in s.help and "|" not in s.help, s.name
        assert isinstance(s.default, s.kind), s.name
        assert s.problem(s.default) is None, s.name  # every default is allowed
        if s.kind in (int, float):
            assert s.unit, f"{s.name} is a number without a unit"
        if s.unit == BYTES:
            assert s.kind is int, s.name


def test_the_help_shows_every_setting_with_its_help_default_unit_and_variable():
    done = subprocess.run([sys.executable, "-m", "tiercache_service.cli", "serve", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "2000"})  # one line a flag
    assert done.returncode == 0, done.stderr
    entries = re.split(r"\n(?=  -)", done.stdout.partition("options:\n")[2])
    lines = {e.split()[0].rstrip(","): " ".join(e.split()) for e in entries}  # flag: its help
    for s in SETTINGS:
        line = lines.get(s.flag)
        assert line, f"{s.flag} is not in tiercache serve --help"
        assert s.help in line and f"default {s.text(s.default)};" in line, line
        assert f"env {s.env}]" in line, line
        assert not s.unit or f"[{s.unit}" in line, line
        assert all(choice in line for choice in s.choices), line
    assert "512MiB" in lines["--host-budget"]  # sizes say they take units


def test_the_readme_lists_every_setting_as_declared():
    readme = (ROOT / "README.md").read_text()
    assert markdown_table() in readme, (
        "README.md's table of settings differs from the declaration: paste in the output of "
        "python -c 'import tiercache_service.config as c; print(c.markdown_table())'")


def serve(data_dir: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`tiercache serve` that is expected to refuse: its exit and what it said."""
    return subprocess.run([sys.executable, "-m", "tiercache_service.cli", "serve", "--data-dir", str(data_dir),
                           "--metrics-address", "", "--no-disk", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def refused(done: subprocess.CompletedProcess, said: str) -> None:
    """Exit 2 and one line, no traceback."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and done.stderr == f"tiercache: {said}\n"


@pytest.mark.parametrize("text, said", [
    ("host_budget = [unclosed\n", "{path} is not valid TOML (Invalid value (at line 1, column 16)) "
                                  "'host_budget = [unclosed': fix that line"),
    ("max_workers = [1, 2]\n", "{path}: max_workers = [1, 2] is a list, not a whole number "
                               "(workers): write e.g. max_workers = 32"),
    ("max_workers = true\n", "{path}: max_workers = true is a boolean, not a whole number "
                             "(workers): write e.g. max_workers = 32"),
])
def test_a_bad_file_is_refused_in_one_line_naming_it_and_the_setting(tmp_path, text, said):
    path = tmp_path / "tiercache.toml"
    path.write_text(text)
    refused(serve(tmp_path / "data", "--config", str(path)),
            said.format(path=("--config " if "TOML" in said else "") + str(path)))


def test_a_bad_variable_is_refused_naming_it(tmp_path):
    done = serve(tmp_path / "data", env={"TIERCACHE_MAX_WORKERS": "tcp://10.0.0.1:9477"})
    refused(done, "TIERCACHE_MAX_WORKERS='tcp://10.0.0.1:9477' is not a whole number (workers): "
                  "write e.g. TIERCACHE_MAX_WORKERS=32")


# What the kubelet puts into every container of a namespace with Services named tiercache
# (ports metrics and health) and tiercache-remote
KUBERNETES = {"TIERCACHE_SERVICE_HOST": "10.96.0.12", "TIERCACHE_SERVICE_PORT": "9477",
              "TIERCACHE_SERVICE_PORT_METRICS": "9477", "TIERCACHE_SERVICE_PORT_HEALTH": "9478",
              "TIERCACHE_PORT": "tcp://10.96.0.12:9477",
              "TIERCACHE_PORT_9477_TCP": "tcp://10.96.0.12:9477",
              "TIERCACHE_PORT_9477_TCP_PROTO": "tcp", "TIERCACHE_PORT_9477_TCP_PORT": "9477",
              "TIERCACHE_PORT_9477_TCP_ADDR": "10.96.0.12",
              "TIERCACHE_REMOTE_SERVICE_HOST": "10.96.0.13",
              "TIERCACHE_REMOTE_PORT": "tcp://10.96.0.13:7000"}


def test_kubernetes_service_links_cannot_name_a_setting():
    assert all(SERVICE_LINK.fullmatch(name) for name in KUBERNETES)
    # so none of them is ever read as one: no setting may be called port, *_port,
    # service_host ...
    assert not [s.env for s in SETTINGS if SERVICE_LINK.fullmatch(s.env)]


def test_variables_that_are_not_settings_are_ignored_with_one_warning(tmp_path, monkeypatch):
    for name, value in {**KUBERNETES, "TIERCACHE_HOST_BUDGT": "1GiB"}.items():
        monkeypatch.setenv(name, value)
    # the daemon starts, with a setting given by the environment ...
    monkeypatch.setenv("TIERCACHE_MAX_WORKERS", "3")
    with running_daemon(tmp_path) as (_, process):
        assert "'max_workers': 3" in process.startup_line or "max_workers=3" in process.startup_line
        # ... and says, in one line, what it ignored and why
        warned = [line for line in process.warnings if "ignoring" in line]
        assert len(warned) == 1, process.warnings
        assert ", ".join(sorted(KUBERNETES)) + " (Kubernetes service links: enableServiceLinks: " \
            "false in the pod spec stops them); TIERCACHE_HOST_BUDGT (did you mean " \
            "TIERCACHE_HOST_BUDGET?)" in warned[0]
