"""Abuse of the gRPC surface: each gets a clear status (or the connection is sent away),
the daemon's memory stays bounded and it goes on serving. TLS, mTLS and tokens are in
test_isolation.py."""

from __future__ import annotations

import socket
import struct
import threading

import grpc
import pytest

from drills import prompts
from tests.service.daemon import running_daemon
from tiercache.client import Client
from tiercache.errors import ResourceExhausted
from tiercache.v1 import tiercache_pb2 as pb

MiB = 1 << 20


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def frame(kind: int, stream: int = 0, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame (no flags)."""
    return struct.pack(">I", len(payload))[1:] + bytes([kind, 0]) + struct.pack(">I", stream) + payload


def h2_connection(address: str) -> socket.socket:
    """A raw HTTP/2 connection to the daemon's socket: preface and empty SETTINGS sent."""
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(address[len("unix:"):])
    raw.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4))
    raw.settimeout(10)
    return raw


def ping_flood(raw: socket.socket, pings: int) -> int:
    """Send PING frames as fast as the daemon takes them; how many it took before it
    closed the connection (it answers too_many_pings with a GOAWAY first, which a flood
    that does not read cannot see)."""
    for n in range(pings):
        try:
            raw.sendall(frame(6, payload=struct.pack(">Q", n)))
        except OSError:
            return n
    return pings


def test_a_ping_flood_is_sent_away_and_costs_nothing(tmp_path):
    with running_daemon(tmp_path, "--no-disk") as (address, daemon):
        before = rss(daemon.pid)
        for attempt in range(20):  # twenty connections, each pinging as fast as it can
            raw = h2_connection(address)
            # the daemon hangs up after a few strikes; what it took beyond them sat in the
            # socket buffers (about 25,000 frames fit there)
            assert ping_flood(raw, 100_000) < 60_000
            raw.close()
        assert rss(daemon.pid) - before < 32 * MiB
        assert Client(address).stats().workers == 0  # still serving


def test_idle_connections_do_not_stop_service(tmp_path):
    with running_daemon(tmp_path, "--no-disk") as (address, daemon):
        before = rss(daemon.pid)
        held = [h2_connection(address) for _ in range(300)]
        worker = Client(address).register(prompts.MODEL, prompts.LAYOUT)
        assert worker.match(prompts.tokens(0)).pages == 0
        assert rss(daemon.pid) - before < 64 * MiB
        for raw in held:
            raw.close()
        worker.close()


def test_oversize_messages_are_refused_and_memory_stays_bounded(tmp_path):
    with running_daemon(tmp_path, "--no-disk", "--max-message-bytes", "1MiB") as (address, daemon):
        stub = Client(address)._stub
        before = rss(daemon.pid)
        for _ in range(20):  # 20 x 8 MiB: refused before they are read whole
            with pytest.raises(grpc.RpcError) as refused:
                stub.Match(pb.MatchRequest(worker_id="w", keys=b"\1" * (8 * MiB)), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert rss(daemon.pid) - before < 64 * MiB


def test_calls_beyond_the_concurrency_limit_are_resource_exhausted(tmp_path, monkeypatch):
    # every store sleeps half a second before copying, so calls pile up
    monkeypatch.setenv("TIERCACHE_FAILPOINTS", "store.before_gather=sleep(0.5)")
    flags = ("--no-disk", "--max-concurrent-rpcs", "2", "--max-workers", "1")
    with running_daemon(tmp_path, *flags) as (address, daemon):
        worker = Client(address).register(prompts.MODEL, prompts.LAYOUT)
        outcomes: list[str] = []

        def store(n: int) -> None:
            try:
                worker.store(prompts.tokens(n), kv_rows=range(prompts.PAGES),
                             checkpoints={prompts.PAGES * prompts.PAGE: 0})
                outcomes.append("ok")
            except ResourceExhausted:
                outcomes.append("exhausted")
        threads = [threading.Thread(target=store, args=(n,)) for n in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # two at a time are served (the registration holds its own slot), the rest are
        # told at once; nothing else happened to any of them
        assert outcomes.count("ok") >= 2 and outcomes.count("exhausted") >= 6
        assert len(outcomes) == 12
        worker.store(prompts.tokens(99), kv_rows=range(prompts.PAGES))  # served again
        worker.close()


def test_registrations_are_capped_per_daemon_and_per_tenant(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.acme]\ntokens = ["a"]\n[tenants.beta]\ntokens = ["b"]\n')
    tenants.chmod(0o600)
    flags = ("--no-disk", "--tenants-file", str(tenants), "--max-workers", "4",
             "--max-workers-per-tenant", "2")
    with running_daemon(tmp_path / "data", *flags) as (address, _):
        acme = [Client(address, token="a").register(prompts.MODEL, prompts.LAYOUT) for _ in range(2)]
        with pytest.raises(ResourceExhausted, match="max-workers-per-tenant"):
            Client(address, token="a").register(prompts.MODEL, prompts.LAYOUT)
        beta = [Client(address, token="b").register(prompts.MODEL, prompts.LAYOUT) for _ in range(2)]
        with pytest.raises(ResourceExhausted, match="max-workers"):
            Client(address, token="b").register(prompts.MODEL, prompts.LAYOUT)
        for worker in acme + beta:
            worker.close()
