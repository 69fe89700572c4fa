"""Match latency over the daemon's Unix socket, beside an empty RPC on the same server.

A daemon process holds a 4k-token and a 32k-token prompt (pages of 16 tokens, a
checkpoint at the end), so every match walks the whole prompt. The empty RPC is the
gRPC health check on the same server. Each Match is timed two ways: as a message on the
worker's stream of calls (what the client does by default, tiercache/call_stream.py) and
as a call of its own (`Client(streamed_calls=False)`). Throughput: 8 client processes,
each on its own channel with a worker of its own, matching the 4k prompt in a loop, each
way; beside it, the same 8 processes calling the empty RPC in a loop (what the server and
the clients' own gRPC can do on this machine).
"""

from __future__ import annotations

import multiprocessing
import tempfile
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common import print_summary, print_table
from tiercache_service.process import spawn
from tiercache.client import Client
from tiercache.layout import BufferSpec, Layout

LAYOUT = Layout(16, paged=(BufferSpec("kv", 2048, (16, 64), "bfloat16"),),
                slots=(BufferSpec("state", 2, (256,), "float32"),))
CLIENTS, SECONDS = 8, 3.0


def prompt(tokens: int) -> list[int]:
    return np.random.default_rng(tokens).integers(0, 150_000, tokens).tolist()


def percentiles(call, count: int = 2000) -> tuple[float, float]:
    for _ in range(200):
        call()
    times = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


def hammer(address: str, keys: bytes, streamed: bool, ready, go, counts) -> None:
    """Match the prompt `keys` in a loop, on a stream of calls or as calls of their own;
    with no keys, the empty RPC (the health check), counting the calls answered (the
    daemon turns away health checks beyond its slots)."""
    from tiercache.call_stream import CallStream
    from tiercache.v1 import tiercache_pb2 as pb
    from tiercache.v1 import tiercache_pb2_grpc as pb_grpc
    channel = grpc.insecure_channel(address)
    if keys:
        worker = Client(address).register("bench-model", LAYOUT)  # a stream is one worker's
        stub = pb_grpc.TiercacheStub(channel)
        request = pb.MatchRequest(worker_id=worker._backend._id, keys=keys)
        stream = CallStream(lambda requests: stub.Calls(requests))
        call = ((lambda: stream.send("match", request, 30.0)) if streamed  # noqa: E731
                else (lambda: stub.Match(request)))
    else:
        health = health_pb2_grpc.HealthStub(channel)
        call = lambda: health.Check(health_pb2.HealthCheckRequest())  # noqa: E731
    def answered() -> bool:
        try:
            call()
            return True
        except grpc.RpcError as error:  # health checks: at most 4 at once from one peer
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return False
    while not answered():
        pass
    ready.release()
    go.wait()
    done, end = 0, time.perf_counter() + SECONDS
    while time.perf_counter() < end:
        done += answered()
    counts.put(done)


def throughput(address: str, keys: bytes, streamed: bool = False) -> float:
    """Calls a second from CLIENTS processes at once (`keys`: Match; b"": the empty RPC)."""
    context = multiprocessing.get_context("spawn")  # forking a process with gRPC threads can hang
    ready, go, counts = context.Semaphore(0), context.Event(), context.Queue()
    clients = [context.Process(target=hammer, args=(address, keys, streamed, ready, go, counts))
               for _ in range(CLIENTS)]
    for c in clients:
        c.start()
    for _ in clients:
        ready.acquire()
    go.set()
    total = sum(counts.get() for _ in clients)
    for c in clients:
        c.join()
    return total / SECONDS


def main() -> None:
    # forwarded: the empty RPCs turned away are logged, and a full pipe would stop the daemon
    with spawn(tempfile.mkdtemp(prefix="tiercache-bench-"), "--host-budget", "1GiB",
               forward_output=True) as (address, _):
        worker = Client(address).register("bench-model", LAYOUT)
        unary = Client(address, streamed_calls=False).register("bench-model", LAYOUT)
        keys = {}
        for tokens in (4096, 32768):
            keys[tokens] = worker.keys(prompt(tokens))
            pages = len(keys[tokens])
            worker.store(keys=keys[tokens], kv_rows=range(pages), checkpoints={pages * 16: 0})
            assert worker.match(keys=keys[tokens]).pages == pages
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
        empty = percentiles(lambda: health.Check(health_pb2.HealthCheckRequest()))
        match = {t: percentiles(lambda t=t: worker.match(keys=keys[t])) for t in keys}
        match_unary = {t: percentiles(lambda t=t: unary.match(keys=keys[t])) for t in keys}
        assert worker._backend._calls._replies is not None  # the matches went on the stream
        per_s = throughput(address, b"".join(keys[4096]), streamed=True)
        unary_per_s = throughput(address, b"".join(keys[4096]))
        empty_per_s = throughput(address, b"")
        worker.close()
        unary.close()
    rows = [("empty RPC (health)", empty[0] * 1e6, empty[1] * 1e6, 1.0)]
    for how, got in (("streamed", match), ("a call of its own", match_unary)):
        rows += [(f"match {t // 1024}k ({t // 16} pages), {how}", m[0] * 1e6, m[1] * 1e6,
                  m[0] / empty[0]) for t, m in got.items()]
    print_table("Match over the Unix socket", ["call", "p50 us", "p99 us", "p50 / empty"], rows)
    print(f"{CLIENTS} client processes: match 4k {per_s:.0f}/s streamed, {unary_per_s:.0f}/s as "
          f"calls of their own; the empty RPC {empty_per_s:.0f}/s on the same daemon "
          f"({per_s / empty_per_s:.2f}, {unary_per_s / empty_per_s:.2f})")
    print_summary(match32k_over_empty_p50=match[32768][0] / empty[0],
                  match4k_over_empty_p50=match[4096][0] / empty[0],
                  match32k_unary_over_empty_p50=match_unary[32768][0] / empty[0],
                  match_per_s_8_clients=per_s, match_unary_per_s_8_clients=unary_per_s,
                  empty_per_s_8_clients=empty_per_s,
                  match_over_empty_per_s=per_s / empty_per_s, empty_p50_us=empty[0] * 1e6)


if __name__ == "__main__":
    main()
