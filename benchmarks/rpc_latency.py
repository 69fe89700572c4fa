"""Match latency over the daemon's Unix socket, beside an empty RPC on the same server.

A daemon process holds a 4k-token and a 32k-token prompt (pages of 16 tokens, a
checkpoint at the end), so every match walks the whole prompt. The empty RPC is the
gRPC health check on the same server. Each Match is timed three ways: through the
worker's lane (what the client does by default on the daemon's node, tiercache/lane.py),
as a message on the worker's stream of calls (`Client(lanes=False)`,
tiercache/call_stream.py) and as a call of its own (`Client(streamed_calls=False,
lanes=False)`). Throughput: 8 client processes, each on its own channel with a worker of
its own, matching the 4k prompt in a loop, each way; beside it, the same 8 processes
calling the empty RPC in a loop (what the server and the clients' own gRPC can do on this
machine).
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


WAYS = {"lane": {}, "streamed": {"lanes": False},
        "a call of its own": {"lanes": False, "streamed_calls": False}}  # Client options


def hammer(address: str, tokens: int, way: str, ready, go, counts) -> None:
    """Match a prompt of `tokens` tokens in a loop, the `way` WAYS names; with no tokens,
    the empty RPC (the health check), counting the calls answered (the daemon turns away
    health checks beyond its slots)."""
    if tokens:
        worker = Client(address, **WAYS[way]).register("bench-model", LAYOUT)
        keys = worker.keys(prompt(tokens))
        call = lambda: worker.match(keys=keys)  # noqa: E731
    else:
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
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


def throughput(address: str, tokens: int, way: str = "") -> float:
    """Calls a second from CLIENTS processes at once (`tokens`: Match; 0: the empty RPC)."""
    context = multiprocessing.get_context("spawn")  # forking a process with gRPC threads can hang
    ready, go, counts = context.Semaphore(0), context.Event(), context.Queue()
    clients = [context.Process(target=hammer, args=(address, tokens, way, ready, go, counts))
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
        workers = {way: Client(address, **options).register("bench-model", LAYOUT)
                   for way, options in WAYS.items()}
        keys = {}
        for tokens in (4096, 32768):
            keys[tokens] = workers["lane"].keys(prompt(tokens))
            pages = len(keys[tokens])
            workers["lane"].store(keys=keys[tokens], kv_rows=range(pages), checkpoints={pages * 16: 0})
            assert workers["lane"].match(keys=keys[tokens]).pages == pages
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
        empty = percentiles(lambda: health.Check(health_pb2.HealthCheckRequest()))
        match = {way: {t: percentiles(lambda t=t: worker.match(keys=keys[t])) for t in keys}
                 for way, worker in workers.items()}
        lane = workers["lane"]._backend._ways[0]
        assert lane._number > 4000, "the lane's matches went elsewhere"
        per_s = {way: throughput(address, 4096, way) for way in WAYS}
        empty_per_s = throughput(address, 0)
        for worker in workers.values():
            worker.close()
    rows = [("empty RPC (health)", empty[0] * 1e6, empty[1] * 1e6, 1.0)]
    for way, got in match.items():
        rows += [(f"match {t // 1024}k ({t // 16} pages), {way}", m[0] * 1e6, m[1] * 1e6,
                  m[0] / empty[0]) for t, m in got.items()]
    print_table("Match over the Unix socket", ["call", "p50 us", "p99 us", "p50 / empty"], rows)
    print(f"{CLIENTS} client processes: match 4k " + ", ".join(
        f"{n:.0f}/s {way} ({n / empty_per_s:.2f})" for way, n in per_s.items())
        + f"; the empty RPC {empty_per_s:.0f}/s on the same daemon")
    print_summary(match32k_over_empty_p50=match["lane"][32768][0] / empty[0],
                  match4k_over_empty_p50=match["lane"][4096][0] / empty[0],
                  match32k_streamed_over_empty_p50=match["streamed"][32768][0] / empty[0],
                  match32k_unary_over_empty_p50=match["a call of its own"][32768][0] / empty[0],
                  match_per_s_8_clients=per_s["lane"], match_streamed_per_s_8_clients=per_s["streamed"],
                  match_unary_per_s_8_clients=per_s["a call of its own"],
                  empty_per_s_8_clients=empty_per_s,
                  match_over_empty_per_s=per_s["lane"] / empty_per_s, empty_p50_us=empty[0] * 1e6)

if __name__ == "__main__":
    main()
