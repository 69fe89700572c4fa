"""The interceptors' handler for a method, built once (observe.PerMethod), over a real
server and socket: every call still gets its own request id, status and metrics."""

from __future__ import annotations

import tempfile
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry

from tiercache_service.logs import REQUEST_ID
from tiercache_service.metrics import CallMetrics
from tiercache_service.observe import ObservingInterceptor, PerMethod


def test_a_known_method_is_asked_for_once_and_an_unknown_name_every_time():
    asked = []

    def continuation(details):
        asked.append(details.method)
        return None if details.method == "/x.Y/Nothing" else object()
    per_method = PerMethod()
    for method in ("/x.Y/Call", "/x.Y/Nothing", "/x.Y/Call", "/x.Y/Nothing", "/x.Y/Other"):
        per_method.intercept_service(continuation, SimpleNamespace(method=method))
    assert asked == ["/x.Y/Call", "/x.Y/Nothing", "/x.Y/Nothing", "/x.Y/Other"]


@pytest.fixture
def served():
    seen = []

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        seen.append(REQUEST_ID.get())
        if request == b"fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "asked to fail")
        return request
    registry = CollectorRegistry()
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[
        PerMethod(), ObservingInterceptor(CallMetrics(registry))])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    path = tempfile.mktemp(suffix=".sock")
    server.add_insecure_port(f"unix:{path}")
    server.start()
    channel = grpc.insecure_channel(f"unix:{path}")
    yield channel.unary_unary("/t.T/Echo"), seen, registry
    channel.close()
    server.stop(0)


def test_each_call_of_a_kept_method_has_its_own_request_id_status_and_count(served):
    call, seen, registry = served
    ids = []
    for rid in ("req-1", "req-2", None, None):
        metadata = (("x-request-id", rid),) if rid else ()
        reply, state = call.with_call(b"hi", metadata=metadata)
        assert reply == b"hi"
        ids.append(dict(state.trailing_metadata())["x-request-id"])
    assert ids[:2] == ["req-1", "req-2"] and len(set(ids)) == 4  # two made up, each new
    assert seen == ids
    with pytest.raises(grpc.RpcError) as failed:
        call(b"fail", metadata=(("x-request-id", "req-3"),))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(failed.value.trailing_metadata())["x-request-id"] == "req-3"
    count = lambda code: registry.get_sample_value(  # noqa: E731
        "tiercache_rpc_requests_total", {"service": "t.T", "method": "Echo", "code": code})
    assert (count("OK"), count("INVALID_ARGUMENT")) == (4, 1)
