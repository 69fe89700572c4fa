"""Starting and stopping the daemon: engine, gRPC server, health, signals.

Shutdown order on SIGTERM or SIGINT: health goes NOT_SERVING (load balancers and
probes stop sending work), the server stops accepting calls and gives those in flight
`grace_seconds`, registrations end, and the engine flushes its host tier to LMDB and
closes it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service import tls
from service.auth import Authenticator, load_tenants
from service.config import ServiceConfig
from service.errors import ErrorInterceptor
from service.servicer import TiercacheServicer
from service.workers import WorkerRegistry
from tiercache import failpoints, tenancy
from tiercache.engine import Engine
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

log = logging.getLogger("tiercache.service")
SERVICE_NAME = "tiercache.v1.Tiercache"


@dataclass
class Daemon:
    config: ServiceConfig
    engine: Engine
    server: grpc.Server
    servicer: TiercacheServicer
    health: health.HealthServicer
    addresses: list[str]

    def stop(self) -> None:
        self.health.enter_graceful_shutdown()  # every service NOT_SERVING, from now on
        self.servicer.stopping.set()
        self.server.stop(self.config.grace_seconds).wait()
        self.servicer.registry.remove_all()
        self.engine.close(flush=self.config.flush_on_exit)
        if os.path.exists(self.config.socket_path):
            os.unlink(self.config.socket_path)


def _free_socket(path: str) -> None:
    """Remove a socket file a dead daemon left behind; refuse if one is alive there."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: stale
        return
    finally:
        probe.close()
    raise RuntimeError(f"another tiercache daemon is listening on {path}: stop it or use --socket")


def start(config: ServiceConfig) -> Daemon:
    auth = Authenticator(load_tenants(config.tenants_file), config.socket_tenant,
                         config.require_identity, config.hash)
    os.makedirs(config.data_dir, exist_ok=True)
    secret = tenancy.load_secret(os.path.join(config.data_dir, "secret"))
    engine = Engine.open(config.engine())
    registry = WorkerRegistry(config.max_workers, engine.quiesce, secret,
                              config.max_workers_per_tenant)
    servicer = TiercacheServicer(engine, registry, config.max_prompt_pages, auth)
    # every registered worker holds one stream (and one thread) open for its lifetime
    calls = config.max_concurrent_rpcs + config.max_workers
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=calls, thread_name_prefix="tiercache-rpc"),
        interceptors=[ErrorInterceptor()], maximum_concurrent_rpcs=calls,
        options=[("grpc.max_receive_message_length", config.max_message_bytes),
                 ("grpc.max_send_message_length", config.max_message_bytes),
                 ("grpc.so_reuseport", 0),
                 # a client pinging more than once a minute between calls is sent away
                 # (GOAWAY after two strikes): a ping flood costs the daemon nothing
                 ("grpc.http2.min_recv_ping_interval_without_data_ms", 60_000),
                 ("grpc.http2.max_ping_strikes", 2)])
    pb_grpc.add_TiercacheServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    addresses = [_bind_socket(server, config.socket_path)]
    if config.tcp:
        addresses.append(_bind_tcp(server, config))
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Daemon(config, engine, server, servicer, health_servicer, addresses)


def _bind_tcp(server: grpc.Server, config: ServiceConfig) -> str:
    if config.tls_cert:
        port = server.add_secure_port(config.tcp, tls.server_credentials(
            config.tls_cert, config.tls_key, config.tls_client_ca))
    else:
        log.warning("TCP %s is plaintext: anyone who can reach it can read and send keys",
                    config.tcp)
        port = server.add_insecure_port(config.tcp)
    if not port:
        raise RuntimeError(f"cannot listen on {config.tcp}: is the port taken?")
    return config.tcp.rsplit(":", 1)[0] + f":{port}"  # the port given, or the one picked for :0


def _bind_socket(server: grpc.Server, path: str) -> str:
    _free_socket(path)
    old = os.umask(0o177)  # the socket file is created 0600: the daemon's user only
    try:
        server.add_insecure_port(f"unix:{path}")
    finally:
        os.umask(old)
    return f"unix:{os.path.abspath(path)}"


def serve(config: ServiceConfig) -> int:
    """Run until SIGTERM or SIGINT; returns the process exit code."""
    # Copies run on the engine's own few threads; torch's OpenMP pool would only spin
    # between them and take CPU from the gRPC threads and the workers next door.
    torch.set_num_threads(1)
    armed = os.environ.get("TIERCACHE_FAILPOINTS", "")
    if armed:  # fault-injection drills only (tiercache.failpoints)
        log.warning("failpoints armed: %s", armed)
        failpoints.arm_from(armed)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    daemon = start(config)
    stats = daemon.engine.stats()
    log.info("tiercache listening on %s (host budget %d bytes, data in %s, %d cached entries)",
             " and ".join(daemon.addresses), config.host_budget, os.path.abspath(config.data_dir),
             sum(t.entries for t in stats.tiers if t.tier.name == "DISK"))
    print(f"tiercache listening on {' and '.join(daemon.addresses)}", flush=True)
    stop.wait()
    log.info("stopping: health NOT_SERVING, %.0f s grace for calls in flight", config.grace_seconds)
    daemon.stop()
    log.info("stopped")
    return 0
