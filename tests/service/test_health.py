"""What generic gRPC tools see of a real daemon: reflection lists the service and its
methods; health says SERVING, then NOT_SERVING after SIGTERM while the server still
answers, on the socket and on the health-only TCP listener alike."""

from __future__ import annotations

import os
import re
import signal

import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from tests.service.daemon import running_daemon
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

SERVICE = "tiercache.v1.Tiercache"
Status = health_pb2.HealthCheckResponse


def check(channel: grpc.Channel, service: str = SERVICE) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_reflection_lists_the_service_and_its_methods(tmp_path):
    with running_daemon(tmp_path) as (address, _):
        database = ProtoReflectionDescriptorDatabase(grpc.insecure_channel(address))
        assert {SERVICE, "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= set(database.get_services())
        # the methods, with their message types, as the .proto declares them
        served = DescriptorPool(database).FindServiceByName(SERVICE)
        declared = pb.DESCRIPTOR.services_by_name["Tiercache"]
        assert [(m.name, m.input_type.full_name, m.output_type.full_name) for m in served.methods] == [
            (m.name, m.input_type.full_name, m.output_type.full_name) for m in declared.methods]
        assert "keys" in DescriptorPool(database).FindMessageTypeByName(
            "tiercache.v1.MatchRequest").fields_by_name


def test_health_goes_not_serving_on_sigterm_before_the_server_stops(tmp_path):
    # the drain keeps the server answering for 3 s after NOT_SERVING: long enough for a
    # poll to see it, as a Kubernetes probe would
    with running_daemon(tmp_path, "--drain-seconds", "3", "--health-address", "127.0.0.1:0") as (
            address, process):
        tcp = re.search(r"health=(\S+)", process.startup_line).group(1)
        on_socket, on_tcp = grpc.insecure_channel(address), grpc.insecure_channel(tcp)
        # 1. serving, on both doors, for the whole server and for the service
        assert check(on_socket, "") == check(on_socket) == check(on_tcp) == Status.SERVING
        # the TCP door answers health only, never the cache
        stats = pb_grpc.TiercacheStub(on_tcp).Stats
        assert _code(lambda: stats(pb.StatsRequest(), timeout=5)) == grpc.StatusCode.UNIMPLEMENTED
        watch = health_pb2_grpc.HealthStub(on_socket).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=30)
        assert next(watch).status == Status.SERVING
        # 2. SIGTERM: the watcher is told NOT_SERVING ...
        process.send_signal(signal.SIGTERM)
        assert next(watch).status == Status.NOT_SERVING
        # ... and a fresh Check on either door still gets an answer, NOT_SERVING: the
        # server has not stopped, its socket is still there
        assert check(on_socket) == check(on_tcp) == Status.NOT_SERVING
        assert process.poll() is None and os.path.exists(address.removeprefix("unix:"))
        # 3. then the server stops: the watch ends, the socket goes, the process exits cleanly
        assert _code(lambda: next(watch)) in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert process.wait(timeout=30) == 0
        assert not os.path.exists(address.removeprefix("unix:"))
        assert _code(lambda: check(on_tcp)) == grpc.StatusCode.UNAVAILABLE


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    raise AssertionError("the call succeeded")
