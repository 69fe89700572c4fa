"""The metrics and health doors: their settings are checked up front, metrics are on
localhost unless asked otherwise, and a port that is taken stops the daemon with a
message that says what to do."""

from __future__ import annotations

import json
import socket

import pytest

from tiercache_service.config import ServiceConfig, host_port, load
from tests.service.daemon import running_daemon
from tiercache.errors import InvalidArgument


def test_metrics_are_on_localhost_by_default_and_probes_are_off():
    config = load(environ={})
    assert host_port(config.metrics_address, "metrics_address") == ("127.0.0.1", 9477)
    assert (config.health_address, config.drain_seconds, config.log_format) == ("", 0.0, "text")


@pytest.mark.parametrize("address, expected", [("0.0.0.0:9477", ("0.0.0.0", 9477)),
                                               ("[::1]:0", ("::1", 0)),
                                               ("localhost:8081", ("localhost", 8081))])
def test_addresses_read_as_host_and_port(address, expected):
    assert host_port(address, "metrics_address") == expected


@pytest.mark.parametrize("settings, message", [
    ({"TIERCACHE_METRICS_ADDRESS": "9477"}, "metrics_address='9477' is not host:port"),
    ({"TIERCACHE_HEALTH_ADDRESS": "0.0.0.0:99999"}, "health_address='0.0.0.0:99999'"),
    ({"TIERCACHE_LOG_FORMAT": "xml"}, "log_format must be one of text, json"),
    ({"TIERCACHE_LOG_LEVEL": "loud"}, "log_level must be one of debug, info"),
    ({"TIERCACHE_DRAIN_SECONDS": "-1"}, "drain_seconds must be 0 or more"),
])
def test_bad_operation_settings_say_what_to_write(settings, message):
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[")):
        load(environ=settings)


def test_metrics_off_is_an_empty_address():
    assert load(environ={"TIERCACHE_METRICS_ADDRESS": ""}) == ServiceConfig(metrics_address="")


def test_a_taken_metrics_port_stops_the_daemon_with_a_clear_message(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(RuntimeError, match=f"cannot serve metrics on 127.0.0.1:{port}.*"
                                               "--metrics-address"):
            with running_daemon(tmp_path, "--metrics-address", f"127.0.0.1:{port}"):
                pass
    finally:
        taken.close()
    # and nothing is left listening on its socket: a new daemon starts there
    with running_daemon(tmp_path) as (address, process):
        assert process.poll() is None


def test_metrics_can_be_turned_off(tmp_path):
    with running_daemon(tmp_path, "--metrics-address", "", "--log-format", "json") as (_, process):
        assert json.loads(process.startup_line)["metrics"] == "off"
