"""The daemon's doors beside the data plane: the Prometheus endpoint (HTTP) and a gRPC
listener that serves nothing but health. Kubernetes' gRPC probes speak plaintext gRPC
over TCP to the pod's address and cannot reach a Unix socket; this listener lets them
probe without putting the cache itself on the network."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

from tiercache_service.config import ServiceConfig, host_port


@dataclass
class Endpoints:
    metrics_url: str = ""  # where Prometheus scrapes, "" when metrics are off
    health_address: str = ""  # the health-only listener, "" when off
    _http: Any = None
    _health: grpc.Server | None = None

    @classmethod
    def start(cls, config: ServiceConfig, registry: CollectorRegistry,
              health_servicer: health.HealthServicer) -> "Endpoints":
        doors = cls()
        try:
            if config.metrics_address:
                doors._serve_metrics(config.metrics_address, registry)
            if config.health_address:
                doors._serve_health(config.health_address, health_servicer)
        except BaseException:
            doors.stop()
            raise
        return doors

    def _serve_metrics(self, address: str, registry: CollectorRegistry) -> None:
        host, port = host_port(address, "metrics_address")
        try:
            self._http, _ = start_http_server(port, host, registry)
        except OSError as error:
            raise RuntimeError(f"cannot serve metrics on {address}: {error}; choose another "
                               "--metrics-address, or '' to turn metrics off") from None
        bound = self._http.server_address[1]  # port 0 asks for a free one
        shown = f"[{host}]" if ":" in host else host
        self.metrics_url = f"http://{shown}:{bound}/metrics"

    def _serve_health(self, address: str, health_servicer: health.HealthServicer) -> None:
        # the same servicer as the main server: NOT_SERVING shows on both at once
        server = grpc.server(futures.ThreadPoolExecutor(4, thread_name_prefix="tiercache-health"),
                             maximum_concurrent_rpcs=16)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:
            port = 0
        if not port:
            raise RuntimeError(f"cannot listen for health checks on {address}: is the port taken?")
        server.start()
        self._health = server
        self.health_address = f"{address.rpartition(':')[0]}:{port}"

    def stop_health(self) -> None:
        if self._health is not None:
            self._health.stop(0).wait()  # called once the main server has stopped
            self._health = None

    def stop_metrics(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def stop(self) -> None:
        self.stop_health()
        self.stop_metrics()
