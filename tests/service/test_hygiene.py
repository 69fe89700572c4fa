"""What the daemon refuses to start with, said in one line that names what to fix (exit 2,
no traceback), and what it leaves alone: settings out of range, bad TOML, TLS files that
do not fit, files and directories others may write or own, a path that is no socket."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from drills import certs
from tests.service.daemon import ROOT


def serve(data_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    """`tiercache serve` that is expected to refuse: its exit and what it said."""
    return subprocess.run([sys.executable, "-m", "tiercache_service.cli", "serve", "--data-dir", str(data_dir),
                           "--metrics-address", "", "--no-disk", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def refused(done: subprocess.CompletedProcess, *words: str) -> None:
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert "Traceback" not in said and all(w in said for w in words), said


@pytest.mark.parametrize("flag, value, words", [
    ("--drain-seconds", "nan", ("drain_seconds", "finite")),
    ("--grace-seconds", "inf", ("grace_seconds", "finite")),
    ("--grace-seconds", "-1", ("grace_seconds", "0 or more")),
    ("--request-seconds", "0", ("request_seconds", "positive")),
    ("--drain-seconds", "1e9", ("drain_seconds", "over a day")),
    ("--max-calls-per-tenant", "-3", ("max_calls_per_tenant",)),
])
def test_number_settings_out_of_range_are_refused(tmp_path, flag, value, words):
    refused(serve(tmp_path, flag, value), *words)


def test_bad_toml_names_the_file(tmp_path):
    config = tmp_path / "tiercache.toml"
    config.write_text("host_budget = [unclosed\n")
    refused(serve(tmp_path / "data", "--config", str(config)), str(config), "not valid TOML")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("[tenants.acme\n")
    tenants.chmod(0o600)
    refused(serve(tmp_path / "data", "--tenants-file", str(tenants)), str(tenants), "not valid TOML")


@pytest.mark.skipif(not certs.available(), reason="needs openssl")
def test_tls_files_that_do_not_fit_are_named(tmp_path):
    made = certs.make(tmp_path / "certs", ("acme-worker",))
    other_key = made.clients["acme-worker"][1]
    tcp = ("--tcp", "127.0.0.1:0", "--tls-cert", str(made.server[0]))
    refused(serve(tmp_path / "data", *tcp, "--tls-key", str(other_key)), str(other_key), "tls_key")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")
    refused(serve(tmp_path / "data", "--tcp", "127.0.0.1:0", "--tls-cert", str(garbage),
                  "--tls-key", str(made.server[1])), str(garbage))


def test_a_socket_path_naming_a_file_leaves_it_alone(tmp_path):
    precious = tmp_path / "notes.txt"
    precious.write_text("mine")
    refused(serve(tmp_path / "data", "--socket", str(precious)), str(precious), "not a socket")
    assert precious.read_text() == "mine"


def test_files_others_may_write_are_refused_and_readable_ones_warned(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.acme]\ntokens = ["t"]\n')
    tenants.chmod(0o666)
    refused(serve(tmp_path / "data", "--tenants-file", str(tenants)), "may be written by others")
    data = tmp_path / "open"
    data.mkdir()
    data.chmod(0o777)
    refused(serve(data), "data directory", "may be written by others")
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    secret = mine / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o622)
    refused(serve(mine), "secret", "may be written by others")
    if os.getuid() == 0:  # root can hand the secret to another user to see it refused
        secret.chmod(0o600)
        os.chown(secret, 65534, 65534)
        refused(serve(mine), "secret", "belongs to user 65534")
