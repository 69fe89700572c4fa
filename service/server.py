"""Starting and stopping the daemon: engine, gRPC server, health, signals.

Shutdown order on SIGTERM or SIGINT: health goes NOT_SERVING (load balancers and
probes stop sending work) while calls are still answered for `drain_seconds`, the
server stops accepting calls and gives those in flight `grace_seconds`, registrations
end, and the engine flushes its host tier to LMDB and closes it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import prometheus_client
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tiercache_service import cpus, observe, tls
from tiercache_service.auth import Authenticator, load_tenants
from tiercache_service.config import ServiceConfig
from tiercache_service.endpoints import Endpoints
from tiercache_service.errors import ErrorInterceptor
from tiercache_service.fleet import Fleet, names
from tiercache_service.kv_events import KvEventPublisher
from tiercache_service.gate import HEALTH_CALLS, CallGate, GateConfig
from tiercache_service.handover import Handover, handover_path
from tiercache_service.logs import redacted
from tiercache_service.lookups import Lookups
from tiercache_service.metrics import registry_for
from tiercache_service.observe import ObservingInterceptor, PerMethod
from tiercache_service.servicer import TiercacheServicer
from tiercache_service.workers import Limits, WorkerRegistry
from tiercache import __version__, failpoints, tenancy
from tiercache.engine import Engine
from tiercache.events import EventLog
from tiercache.remote import remote_namespace
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

log = logging.getLogger("tiercache.service")
SERVICE_NAME = "tiercache.v1.Tiercache"
# what reflection lists, for grpcurl and friends
REFLECTED = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)


@dataclass
class Daemon:
    config: ServiceConfig
    engine: Engine
    server: grpc.Server
    servicer: TiercacheServicer
    health: health.HealthServicer
    addresses: list[str]
    handover: Handover
    endpoints: Endpoints = field(default_factory=Endpoints)  # metrics, health-only listener
    publisher: KvEventPublisher | None = None  # KV events for routers, if on
    spinners: cpus.Spinners | None = None  # the busy threads that keep the daemon's CPUs awake

    def stop(self) -> None:
        self.health.enter_graceful_shutdown()  # every service NOT_SERVING, from now on
        time.sleep(self.config.drain_seconds)  # for probes that poll: calls still answered
        self.servicer.stopping.set()
        self.server.stop(self.config.grace_seconds).wait()
        self.endpoints.stop_health()
        self.handover.stop()
        self.servicer.registry.remove_all()
        if self.config.flush_on_exit:  # while metrics still answer: a long flush shows there
            try:
                self.engine.flush()
            except Exception:  # the close below flushes again; stopping goes on
                log.exception("flushing the host tier to disk failed")
        self.endpoints.stop_metrics()  # it reads the engine, which closes now
        self.engine.close(flush=self.config.flush_on_exit)  # what stores still running left
        if self.publisher is not None:  # after the engine: its last changes go out too
            self.publisher.stop()
        if os.path.exists(self.config.socket_path):
            os.unlink(self.config.socket_path)
        if self.spinners is not None:
            self.spinners.stop()


def _free_socket(path: str) -> None:
    """Remove a socket file a dead daemon left behind; refuse if one is alive there, or if
    the path is anything but a socket (a file someone named by mistake stays)."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return
    if not stat.S_ISSOCK(found.st_mode):
        raise RuntimeError(f"{path} exists and is not a socket: move it away or choose "
                           "another --socket")
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
    placed = cpus.parse(config.cpus) if config.cpus else None
    if placed is not None:  # first: the threads started from here on inherit it
        cpus.pin(placed)
    auth = Authenticator(load_tenants(config.tenants_file), config.socket_tenant,
                         config.require_identity, config.hash)
    os.makedirs(config.data_dir, mode=0o700, exist_ok=True)
    tenancy.check_private(config.data_dir, "data directory")
    secret = tenancy.load_secret(config.secret_path)
    _free_socket(config.socket_path)
    _free_socket(handover_path(config.socket_path))
    engine = Engine.open(config.engine(remote_namespace(secret)))
    fleet, publisher = _fleet(config, engine)
    handover = Handover(handover_path(config.socket_path)).start()
    registry = WorkerRegistry(config.max_workers, engine.quiesce, secret,
                              config.max_workers_per_tenant,
                              Limits(min_entry_bytes=config.min_entry_bytes), handover)
    lookups = Lookups()
    servicer = TiercacheServicer(engine, registry, config.max_prompt_pages, auth, fleet, lookups)
    metrics, call_metrics = registry_for(engine, registry.__len__, registry.ipc_allocations,
                                         lookups)
    servicer.observe = lambda method, code, seconds, rid, details: observe.record(
        call_metrics, SERVICE_NAME, method, code, seconds, rid, details=lambda: details)
    gate = CallGate(auth, GateConfig(config.max_concurrent_rpcs, config.max_calls_per_tenant,
                                     config.request_seconds))
    # threads: the calls the gate lets in, two streams per registered worker (its
    # registration, its calls), health checks, and room for the calls the gate is turning away
    threads = config.max_concurrent_rpcs + 2 * config.max_workers + HEALTH_CALLS + 16
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tiercache-rpc"),
        # outermost first: every call is observed, then gated, then its errors mapped; the
        # handler they make of a method is built once (PerMethod)
        interceptors=[PerMethod(), ObservingInterceptor(call_metrics), gate, ErrorInterceptor()],
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
    reflection.enable_server_reflection(REFLECTED, server)
    addresses = [_bind_socket(server, config.socket_path)]
    if config.tcp:
        addresses.append(_bind_tcp(server, config))
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    daemon = Daemon(config, engine, server, servicer, health_servicer, addresses, handover,
                    publisher=publisher,
                    spinners=cpus.Spinners(placed) if config.spin else None)
    try:
        daemon.endpoints = Endpoints.start(config, metrics, health_servicer)
    except BaseException:
        daemon.stop()
        raise
    return daemon


def _fleet(config: ServiceConfig, engine: Engine) -> tuple[Fleet, KvEventPublisher | None]:
    """What stores share beyond this node: KV events (started here) and the remote tier's
    local-only tenants and models."""
    events, publisher = None, None
    if config.kv_events:
        events = EventLog()
        engine.attach_events(events)
        publisher = KvEventPublisher(config.kv_events_config(), events).start()
    return Fleet(events, config.kv_events_tenant, names(config.remote_local_tenants),
                 names(config.remote_local_models)), publisher


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
    # the text format would show each counter's creation time as a gauge of its own
    prometheus_client.disable_created_metrics()
    armed = os.environ.get("TIERCACHE_FAILPOINTS", "")
    if armed:  # fault-injection drills only (tiercache.failpoints)
        log.warning("failpoints armed: %s", armed)
        failpoints.arm_from(armed)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    daemon = start(config)
    _announce(daemon)
    # a signal another thread took runs its handler only when this thread next wakes: a
    # wait without a timeout could miss a SIGTERM for good (seen after SIGSTOP/SIGCONT)
    while not stop.wait(0.5):
        pass
    log.info("stopping: health NOT_SERVING, %.0f s grace for calls in flight", config.grace_seconds)
    daemon.stop()
    log.info("stopped")
    return 0


def _announce(daemon: Daemon) -> None:
    """The one startup line: where the daemon listens and its effective configuration."""
    where, doors = " and ".join(daemon.addresses), daemon.endpoints
    disk = sum(t.entries for t in daemon.engine.stats().tiers if t.tier.name == "DISK")
    log.info("tiercache %s listening on %s", __version__, where, extra={"data": {
        "version": __version__, "addresses": daemon.addresses, "metrics": doors.metrics_url or "off",
        "health": doors.health_address or "off", "disk_entries": disk,
        "data_dir": os.path.abspath(daemon.config.data_dir), "config": redacted(daemon.config)}})
    if daemon.config.log_format == "text":  # for people; JSON output stays JSON only
        metrics = f"; metrics on {doors.metrics_url}" if doors.metrics_url else ""
        print(f"tiercache {__version__} listening on {where}{metrics}", flush=True)
