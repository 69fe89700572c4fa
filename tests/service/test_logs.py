"""Log lines: JSON objects from a real daemon, one startup line with the effective
configuration, every call's line carrying its request id, a worker's disconnect, the
shutdown flush and the startup rebuild; the text format and the masking of secrets
in-process."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import signal

import grpc

from tiercache_service.config import ServiceConfig
from tiercache_service.logs import REQUEST_ID, JsonFormatter, TextFormatter, redacted, request_id
from tests.service.daemon import metrics_url, running_daemon, scrape
from tests.service.worker_process import LAYOUT, prompt
from tiercache.client import Client
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc


def test_a_json_daemon_logs_its_configuration_once_and_each_call_with_its_request_id(tmp_path):
    with running_daemon(tmp_path, "--log-format", "json", "--log-level", "debug") as (address, process):
        stub = pb_grpc.TiercacheStub(grpc.insecure_channel(address))
        # 1. a call with the client's own request id gets it back in the trailing metadata
        _, call = stub.Stats.with_call(pb.StatsRequest(), metadata=(("x-request-id", "req-42"),))
        assert ("x-request-id", "req-42") in call.trailing_metadata()
        # 2. a failing call, and a call that brings no id (the daemon makes one up)
        try:
            stub.Evict(pb.EvictRequest(worker_id="nobody", keys=b"\0" * 16),
                       metadata=(("x-request-id", "req-43"),))
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND
        _, call = stub.Stats.with_call(pb.StatsRequest())
        made_up = dict(call.trailing_metadata())["x-request-id"]
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    lines = [json.loads(line) for line in (process.startup_line + output).splitlines()
             if line.startswith("{")]
    # every line the daemon wrote is one JSON object (grpc's own C logs aside)
    assert len(lines) == len([x for x in (process.startup_line + output).splitlines()
                              if not re.match(r"[IWE]\d{4} ", x)])
    # 3. the first line says where it listens and the whole effective configuration
    startup = lines[0]
    assert "listening" in startup["message"] and startup["addresses"] == [address]
    assert startup["config"] == dataclasses.asdict(ServiceConfig(
        data_dir=str(tmp_path), socket=str(tmp_path / "tiercache.sock"), host_budget=64 << 20,
        disk_map_size=256 << 20, grace_seconds=2.0, metrics_address="127.0.0.1:0",
        log_format="json", log_level="debug"))
    assert sum("config" in line for line in lines) == 1
    # 4. one line per call, with its request id, method and status
    calls = {line["request_id"]: line for line in lines if line["logger"] == "tiercache.calls"}
    assert (calls["req-42"]["method"], calls["req-42"]["code"], calls["req-42"]["level"]) == (
        "Stats", "OK", "debug")
    assert (calls["req-43"]["method"], calls["req-43"]["code"], calls["req-43"]["level"]) == (
        "Evict", "NOT_FOUND", "info")
    assert "not registered" in calls["req-43"]["details"]
    assert re.fullmatch(r"[0-9a-f]{16}", made_up) and calls[made_up]["method"] == "Stats"


def record(message: str, **data) -> logging.LogRecord:
    entry = logging.LogRecord("tiercache.test", logging.INFO, __file__, 1, message, (), None)
    entry.data = data
    entry.request_id = REQUEST_ID.get()
    return entry


def test_the_text_format_puts_fields_and_the_request_id_after_the_message():
    token = REQUEST_ID.set("req-7")
    try:
        line = TextFormatter().format(record("Load OK", method="Load", ms=0.25))
        entry = json.loads(JsonFormatter().format(record("Load OK", method="Load")))
    finally:
        REQUEST_ID.reset(token)
    assert line.endswith("INFO tiercache.test: Load OK method=Load ms=0.25 request_id=req-7")
    assert (entry["message"], entry["method"], entry["request_id"]) == ("Load OK", "Load", "req-7")


def test_request_ids_a_client_chooses_are_kept_only_when_sane():
    assert request_id([("x-request-id", "abc-123")]) == "abc-123"
    # too long, or with characters that could forge log lines: replaced by a new one
    for bad in ("x" * 200, "a\nb", "a b", ""):
        assert request_id([("x-request-id", bad)]) != bad
    assert re.fullmatch(r"[0-9a-f]{16}", request_id(None))


def test_settings_that_hold_secrets_are_masked():
    @dataclasses.dataclass
    class WithSecrets:
        socket: str = "/run/tiercache.sock"
        auth_token: str = "hunter2"
        tls_key_password: str = ""
    assert redacted(WithSecrets()) == {"socket": "/run/tiercache.sock", "auth_token": "***",
                                       "tls_key_password": ""}


def test_a_request_that_cannot_be_parsed_is_one_warning_line_not_a_traceback(tmp_path):
    with running_daemon(tmp_path) as (address, process):
        channel = grpc.insecure_channel(address)
        call = channel.unary_unary("/tiercache.v1.Tiercache/Match")  # bytes in, bytes out
        for _ in range(3):
            try:
                call(b"\xff\xff\xff", timeout=10)  # not a MatchRequest
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.INTERNAL
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    warnings = [line for line in output.splitlines() if "could not be parsed" in line]
    assert len(warnings) == 3 and all(" WARNING grpc._common: " in line for line in warnings)
    assert "Traceback" not in output and "ERROR" not in output


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_a_disconnect_the_shutdown_flush_and_the_startup_rebuild_each_say_what_they_did(tmp_path):
    with running_daemon(tmp_path, "--log-format", "json") as (address, process):
        # 1. a worker stores a prompt (6 pages and a checkpoint), then goes away
        worker = Client(address).register("test-model", LAYOUT)
        worker.store(prompt(0), kv_rows=range(6), checkpoints={96: 0})
        worker.close()
        # 2. a fresh disk: nothing was rebuilt
        assert "tiercache_rebuild_entries 0.0" in scrape(metrics_url(process))
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    lines = json_lines(output)
    # 3. the disconnect: one INFO line that says so, no Register CANCELLED
    left = [line for line in lines if line.get("method") == "Register"]
    assert [(x["level"], x["message"].split(" after ")[0], x["disconnected"]) for x in left] == [
        ("info", "Register stream ended: its client disconnected", True)]
    assert not any(line.get("code") == "CANCELLED" for line in lines)
    # 4. the flush at shutdown: what, how much, how long
    flush = [x for x in lines if x["message"].startswith("flushing the host tier to disk")]
    assert [x["message"].split(" in ")[0] for x in flush] == [
        "flushing the host tier to disk: 7 entries",
        "flushing the host tier to disk: done, 7 entries"]
    assert flush[-1]["entries"] == 7 and flush[-1]["seconds"] >= 0
    # 5. started again: the rebuild indexes the 7 entries, logged before it listens, and shown
    with running_daemon(tmp_path, "--log-format", "json") as (address, process):
        rebuild = [x for x in json_lines("".join(process.warnings))
                   if x["message"].startswith("rebuilding the index")]
        assert [x["message"].split(": ", 1)[1].split(" in ")[0] for x in rebuild] == [
            "7 entries", "done, 7 entries"]
        shown = scrape(metrics_url(process))
        assert "tiercache_rebuild_entries 7.0" in shown
        assert float(re.search(r"^tiercache_rebuild_seconds (\S+)$", shown, re.M).group(1)) > 0
