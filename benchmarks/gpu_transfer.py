"""Scattered GPU loads and stores through the daemon, beside the physical limit.

The worker is this process, with CUDA buffers the daemon (a child process) maps by IPC.
For each row size, 24 paged buffers; a prompt of P pages whose rows are scattered over
twice as many rows. Store = worker rows -> daemon (host tier: page-locked memory written
by one Triton launch from the GPU); load = daemon -> other scattered rows. Beside them, in
the same run, right after each row size: one bulk pinned `copy_` of the same byte count
each way (the PCIe limit, its best of 9; ours are medians of 9), and a per-row `copy_` loop
(the naive peer). Times are wall times at the worker, RPC included, until the bytes are
in place: loads and stores as workers call them by default (the daemon replies once the
copy is queued, and the worker's stream waits for it; the benchmark then waits for the
stream), and beside them a load the daemon waits for before it replies
(`synchronous=True`).

Then a 32k-token prefix of a Qwen3-Next-shaped layout (12 attention layers x K, V with 2
KV heads x 256 dims in bf16, pages of 16 tokens; 36 GDN layers with a 32x128x128 fp32
recurrent state and an 8192x3 bf16 conv state): the time until the worker's rows are
copied out by Store (the daemon's device tier takes the bytes device to device; the
worker's stream could write them again from the reply on), and by Worker.post (copied into
the worker's outbox on its own stream; and, apart, until the daemon's reply), beside one
device-to-device copy of the same bytes; and the reload time from the device tier (right
behind the store, while the daemon copies its entries down to the host, and again once
it is idle; and, the daemon idle, by Worker.post_load until the bytes are in place on the
worker's stream, its reply checked after, untimed) and from the host tier, beside a
device-to-device copy and a bulk pinned copy; and the floor of a call through gRPC against
which the device-tier figures stand: an empty RPC (the health check) on the same daemon
plus the device-to-device copy.

With --daemon-cpus N, the daemons run as `--cpus <the first N CPUs> --spin` and this
process (the worker) on the other CPUs: the daemon's threads stay on a few CPUs that never
idle (service/cpus.py). Without it, both run wherever the scheduler puts them.

The workers send their calls through shared memory of their own, their lanes
(tiercache/lane.py); with --no-lanes, as messages of one stream each
(tiercache/call_stream.py); with --unary-calls, each as a call of its own.

With --profile, first: where stores and loads of 512 MiB and of the 32k prefix go, step
by step (tiercache/trace.py: the daemon synchronises with the GPU around each step of a
traced call; a second table without synchronising), beside the worker's wall time of the
same calls and an empty RPC (the health check) on the same daemon; the same calls on
the worker's clock (when the daemon's call starts, when it queues its first copy, when
the GPU starts and ends copying, when the reply comes); and the copy alone, by the Triton
kernel, by the copy engines and by the path CudaTransfer picks, beside a bulk copy; and
how much the worker's own matmuls slow down beside a copy by the kernel or staged.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common import best_seconds, median_seconds, print_summary, print_table
from tiercache_service import cpus
from tiercache_service.process import spawn
from tiercache.client import Client, Worker
from tiercache.results import Tier
from tiercache.layout import BufferSpec, Layout
from tiercache.tiers.arena import SlabPart

MiB = 1 << 20
TOTAL = 512 * MiB
BUFFERS = 24


def bulk(nbytes: int) -> tuple[float, float]:
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(dst, src):
        dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream().synchronize()
    return (best_seconds(lambda: copy(device, host), repeat=9),
            best_seconds(lambda: copy(host, device), repeat=9))


def per_row_loop(buffers, rows, host) -> tuple[float, float]:
    """The naive peer: one copy_ per row and buffer, into and out of page-locked slots."""
    width = buffers[0].shape[1]
    rows = rows.tolist()

    def store():
        for b, buffer in enumerate(buffers):
            for n, r in enumerate(rows):
                host[n, b * width:(b + 1) * width].copy_(buffer[r], non_blocking=True)
        torch.cuda.current_stream().synchronize()

    def load():
        for b, buffer in enumerate(buffers):
            for n, r in enumerate(rows):
                buffer[r].copy_(host[n, b * width:(b + 1) * width], non_blocking=True)
        torch.cuda.current_stream().synchronize()
    return median_seconds(load, repeat=3), median_seconds(store, repeat=3)


@contextmanager
def daemon(placed: int, *flags: str) -> Iterator[str]:
    """A daemon with `flags`, its address; with `placed` N > 0, the daemon's threads on the
    first N of this process's CPUs, kept out of idle, and this process's on the others. Its
    output goes on to stderr: a daemon whose pipe is full would block."""
    allowed = sorted(os.sched_getaffinity(0))
    if not 0 <= placed < len(allowed):
        raise SystemExit(f"--daemon-cpus {placed}: this process has {len(allowed)} CPUs; leave the "
                         "worker at least one")
    own = (("--cpus", ",".join(map(str, allowed[:placed])), "--spin") if placed else ())
    with spawn(tempfile.mkdtemp(prefix="tiercache-bench-"), *flags, *own, forward_output=True) as (address, _):
        if placed:
            cpus.pin(frozenset(allowed[placed:]))
        try:
            yield address
        finally:
            cpus.pin(frozenset(allowed))


CLIENT: dict = {}  # the workers' Client options (--no-lanes, --unary-calls)


def rows_layout(pages: int, row_bytes: int) -> Layout:
    """BUFFERS paged buffers of `row_bytes` rows, twice as many rows as the prompt's pages."""
    return Layout(16, paged=tuple(BufferSpec(f"kv{i}", 2 * pages, (row_bytes // 2,), "bfloat16")
                                  for i in range(BUFFERS)))


def ours(address: str, row_bytes: int) -> tuple[float, float, float, float, float]:
    pages = TOTAL // (BUFFERS * row_bytes)
    layout = rows_layout(pages, row_bytes)
    tensors = {b.name: torch.randint(-2**15, 2**15, b.shape, dtype=torch.int16, device="cuda"
                                     ).view(torch.bfloat16) for b in layout.paged}
    worker = Client(address, **CLIENT).register("bench-model", layout, buffers=tensors)
    order = torch.randperm(2 * pages).tolist()
    src, dst = order[:pages], order[pages:]
    keys = worker.keys(np.random.default_rng(row_bytes).integers(0, 150_000, pages * 16).tolist())

    def store():  # until the copy is done: the worker's stream waits for it from the reply on
        assert worker.store(keys=keys, kv_rows=src).stored == pages
        torch.cuda.current_stream().synchronize()

    def load():  # a worker's default: the reply comes while the copy runs, its stream waits
        assert worker.load(keys=keys, kv_rows=dst).match.pages == pages
        torch.cuda.current_stream().synchronize()

    def load_waited():  # the daemon waits for the copy before it replies
        assert worker.load(keys=keys, kv_rows=dst, synchronous=True).match.pages == pages
    store_s = median_seconds(store, repeat=9, setup=lambda: worker.evict(keys=keys))
    load_s = median_seconds(load, repeat=9)
    waited_s = median_seconds(load_waited, repeat=9)
    raw = [t.view(torch.int16) for t in tensors.values()]
    assert all(torch.equal(t[dst], t[src]) for t in raw)
    host = torch.empty((pages, BUFFERS * row_bytes), dtype=torch.uint8, pin_memory=True)
    naive_load, naive_store = per_row_loop([t.view(torch.uint8).view(2 * pages, -1) for t in tensors.values()],
                                           torch.tensor(src), host)
    worker.close()
    return load_s, waited_s, store_s, naive_load, naive_store


def forget(worker: Worker, keys: list, address: str) -> None:
    """Evict a prompt from every tier. The daemon copies the last store down to the host
    behind it, and entries still being copied stay (pinned while read; the first copy
    down also compiles its kernel): evict again until the daemon holds nothing."""
    deadline = time.monotonic() + 60
    stats = Client(address, **CLIENT)
    try:
        while True:
            time.sleep(0.5)
            worker.evict(keys=keys)
            if not any(t.entries for t in stats.stats().tiers) or time.monotonic() > deadline:
                return
    finally:
        stats.close()


def copied_down(address: str, entries: int) -> None:
    """Wait until the host tier holds `entries` entries: the copies down behind the last
    store are done, and the daemon is idle."""
    deadline = time.monotonic() + 60
    stats = Client(address, **CLIENT)
    try:
        while time.monotonic() < deadline:
            if any(t.tier == Tier.HOST and t.entries >= entries for t in stats.stats().tiers):
                return
            time.sleep(0.01)
        raise RuntimeError(f"the daemon did not copy {entries} entries down to the host in 60 s")
    finally:
        stats.close()


def qwen3_next_layout(pages: int) -> Layout:
    return Layout(16, paged=tuple(BufferSpec(f"attn{i}.{kv}", pages, (16, 2, 256), "bfloat16")
                                  for i in range(12) for kv in "kv"),
                  slots=tuple(spec for i in range(36) for spec in (
                      BufferSpec(f"gdn{i}.recurrent", 2, (32, 128, 128), "float32"),
                      BufferSpec(f"gdn{i}.conv", 2, (8192, 3), "bfloat16"))))


def prefix_32k(address: str) -> dict[str, float]:
    pages = 32768 // 16
    layout = qwen3_next_layout(2 * pages)
    tensors = {b.name: torch.randn(b.shape, device="cuda").to(getattr(torch, b.dtype))
               for b in (*layout.paged, *layout.slots)}
    worker = Client(address, **CLIENT).register("qwen3-next-shaped", layout, buffers=tensors, outbox_pages=pages)
    keys = worker.keys(np.random.default_rng(32).integers(0, 150_000, 32768).tolist())
    nbytes = pages * layout.page_bytes + layout.checkpoint_bytes
    src, dst = list(range(pages)), list(range(pages, 2 * pages))
    posted = []

    def post():  # until the rows may be written again: copied into the worker's outbox
        posted.append(worker.post(keys=keys, kv_rows=src, checkpoints={32768: 0}))
        torch.cuda.current_stream().synchronize()

    def post_replied():  # until the daemon's reply (its copies queued)
        assert worker.post(keys=keys, kv_rows=src, checkpoints={32768: 0}).result().stored == pages + 1

    def answered() -> None:  # the last posts' replies, untimed, then a daemon that holds nothing
        assert all(f.result().stored == pages + 1 for f in posted), [f.result() for f in posted]
        posted.clear()
        forget(worker, keys, address)
    post_s = median_seconds(post, repeat=5, setup=answered)
    replied_s = median_seconds(post_replied, repeat=5, setup=answered)
    worker.load(keys=keys, kv_rows=dst, slot=1, synchronous=True)
    assert all(torch.equal(tensors[b.name][dst].view(torch.int16), tensors[b.name][src].view(torch.int16))
               for b in layout.paged) and torch.equal(tensors["gdn0.recurrent"][1], tensors["gdn0.recurrent"][0])

    def store():  # until the copies are done, as above
        stored = worker.store(keys=keys, kv_rows=src, checkpoints={32768: 0})
        assert stored.stored == pages + 1, stored
        torch.cuda.current_stream().synchronize()

    def reload():  # until the bytes are in place: the worker's stream waits for the copy
        worker.load(keys=keys, kv_rows=dst, slot=1)
        torch.cuda.current_stream().synchronize()
    store_s = median_seconds(store, repeat=5, setup=lambda: forget(worker, keys, address))
    device_s = median_seconds(reload, repeat=5)  # right behind the store: its copies down run
    copied_down(address, pages + 1)
    idle_s = median_seconds(reload, repeat=5)
    loads = []

    def reload_posted():  # until the bytes are in place on the worker's stream
        loads.append(worker.post_load(keys=keys, kv_rows=dst, slot=1))
        torch.cuda.current_stream().synchronize()

    def reply_checked():  # the last posted load's reply, untimed
        assert all(f.result().match.pages == pages for f in loads), [f.result() for f in loads]
        loads.clear()
    posted_s = median_seconds(reload_posted, repeat=5, setup=reply_checked)
    reply_checked()
    assert all(torch.equal(tensors[b.name][dst].view(torch.int16), tensors[b.name][src].view(torch.int16))
               for b in layout.paged)
    host_s = median_seconds(reload, repeat=5, setup=lambda: worker.evict(keys=keys, tier=Tier.DEVICE))
    assert worker.load(keys=keys, kv_rows=dst, slot=1, synchronous=True).bytes_from.keys() == {Tier.HOST}
    worker.close()
    a, b = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))

    def d2d():
        a.copy_(b)
        torch.cuda.current_stream().synchronize()
    d2d_s = best_seconds(d2d, repeat=9)
    h2d_s = bulk(nbytes)[0]
    rpc_s = _empty_rpc_ms(address) / 1e3  # the least any call through gRPC to the daemon takes
    print_table(f"32k-token Qwen3-Next-shaped prefix ({nbytes / MiB:.0f} MiB: KV pages + one checkpoint)",
                ["operation", "ms", "peer", "peer ms", "ours / peer"],
                [("store, rows copied out", store_s * 1e3, "d2d copy", d2d_s * 1e3, store_s / d2d_s),
                 ("post (outbox), rows free", post_s * 1e3, "d2d copy", d2d_s * 1e3, post_s / d2d_s),
                 ("post (outbox), replied", replied_s * 1e3, "d2d copy", d2d_s * 1e3, replied_s / d2d_s),
                 ("reload from device, behind its store", device_s * 1e3, "d2d copy", d2d_s * 1e3,
                  device_s / d2d_s),
                 ("reload from device, idle daemon", idle_s * 1e3, "d2d copy", d2d_s * 1e3, idle_s / d2d_s),
                 ("reload from device, posted: bytes in place", posted_s * 1e3, "d2d copy", d2d_s * 1e3,
                  posted_s / d2d_s),
                 ("reload from host", host_s * 1e3, "bulk h2d", h2d_s * 1e3, host_s / h2d_s),
                 ("empty RPC + d2d copy: the floor", (rpc_s + d2d_s) * 1e3, "d2d copy", d2d_s * 1e3,
                  (rpc_s + d2d_s) / d2d_s)])
    return {"store_32k_over_d2d": store_s / d2d_s, "post_32k_over_d2d": post_s / d2d_s,
            "post_replied_32k_over_d2d": replied_s / d2d_s, "reload_device_32k_over_d2d": device_s / d2d_s,
            "reload_device_idle_32k_over_d2d": idle_s / d2d_s,
            "reload_device_posted_32k_over_d2d": posted_s / d2d_s, "reload_host_32k_over_bulk": host_s / h2d_s,
            "floor_32k_over_d2d": (rpc_s + d2d_s) / d2d_s}


Wall = tuple[str, float, float, float]  # label, start (perf_counter ms), reply and done (ms after start)


def _traced(daemon_args: Sequence[str], calls: Callable[[str], list[Wall]], sync: bool
            ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]], float]:
    """Run `calls` against a daemon whose traced calls write their spans; `calls` returns
    a Wall for each traced call, in order. Per label, the median of each step over the
    calls after the first two (warm-up), and of the worker's wall time; the median
    timeline of the same calls (`_timeline`); and the median ms of an empty RPC on the
    same daemon."""
    with tempfile.TemporaryDirectory() as folder:
        trace_file = os.path.join(folder, "trace.jsonl")
        os.environ["TIERCACHE_TRACE"] = trace_file
        os.environ["TIERCACHE_TRACE_SYNC"] = "1" if sync else "0"
        try:
            with spawn(os.path.join(folder, "d"), *daemon_args, forward_output=True) as (address, _):
                walls = calls(address)
                empty_ms = _empty_rpc_ms(address)
        finally:
            del os.environ["TIERCACHE_TRACE"], os.environ["TIERCACHE_TRACE_SYNC"]
        with open(trace_file) as f:
            records = [json.loads(line) for line in f]
    assert len(records) == len(walls), (len(records), len(walls))
    steps: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    lines: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    for (label, start, reply, done), record in zip(walls, records):
        steps[label].append({**record["ms"], "worker wall": done})
        lines[label].append(_timeline(record, start, reply, done))
    medians = lambda found: {k: float(np.median([r.get(k, 0.0) for r in found[2:]]))  # noqa: E731
                             for k in sorted({k for r in found for k in r},
                                             key=lambda k: (k == "total", k == "worker wall", k))}
    return ({label: medians(found) for label, found in steps.items()},
            {label: medians(found) for label, found in lines.items()}, empty_ms)


TIMELINE = ("daemon's call starts", "first copy queued", "GPU starts copying", "GPU ends copying",
            "GPU copying (sum)", "daemon replies", "worker has the reply", "worker's bytes in place")


def _timeline(record: dict, start: float, reply: float, done: float) -> dict[str, float]:
    """One call on the worker's clock: ms after the worker started it (the daemon's
    monotonic clock is the worker's: one machine), and when each of the daemon's steps
    first started ("match starts")."""
    at = record["at"] - start
    copies = record["gpu"] or [["", 0.0, 0.0, 0.0]]
    values = (at, at + min(c[1] for c in copies), at + min(c[2] for c in copies),
              at + max(c[3] for c in copies), sum(c[3] - c[2] for c in copies),
              at + record["ms"]["total"], reply, done)
    steps = {f"{step} starts": at + ms for step, ms in record["from"].items() if step != "total"}
    return {**dict(zip(TIMELINE, values)), **steps}


def _wall(calls: list[Wall], label: str, fn: Callable[[], object]) -> None:
    start = time.perf_counter()
    fn()
    reply = time.perf_counter()
    torch.cuda.current_stream().synchronize()
    calls.append((label, start * 1e3, (reply - start) * 1e3, (time.perf_counter() - start) * 1e3))


def _empty_rpc_ms(address: str) -> float:
    """The median of an empty RPC (the health check) from this process to the daemon."""
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    return median_seconds(lambda: health.Check(health_pb2.HealthCheckRequest()), repeat=200,
                          warmup=20) * 1e3


def _rows_calls(row_bytes: int, rounds: int = 7) -> Callable[[str], list[Wall]]:
    def calls(address: str) -> list[Wall]:
        pages = TOTAL // (BUFFERS * row_bytes)
        layout = rows_layout(pages, row_bytes)
        tensors = {b.name: torch.zeros(b.shape, dtype=torch.bfloat16, device="cuda") for b in layout.paged}
        worker = Client(address, **CLIENT).register("bench-model", layout, buffers=tensors)
        keys = worker.keys(np.random.default_rng(row_bytes).integers(0, 150_000, pages * 16).tolist())
        walls: list[Wall] = []
        for _ in range(rounds):
            worker.evict(keys=keys)
            torch.cuda.synchronize()
            _wall(walls, "store", lambda: worker.store(keys=keys, kv_rows=range(pages)))
            _wall(walls, "load", lambda: worker.load(keys=keys, kv_rows=range(pages, 2 * pages)))
            _wall(walls, "load, waited", lambda: worker.load(keys=keys, kv_rows=range(pages, 2 * pages),
                                                             synchronous=True))
        worker.close()
        return walls
    return calls


def _prefix_calls(rounds: int = 7) -> Callable[[str], list[Wall]]:
    def calls(address: str) -> list[Wall]:
        pages = 32768 // 16
        layout = qwen3_next_layout(2 * pages)
        tensors = {b.name: torch.zeros(b.shape, dtype=getattr(torch, b.dtype), device="cuda")
                   for b in (*layout.paged, *layout.slots)}
        worker = Client(address, **CLIENT).register("qwen3-next-shaped", layout, buffers=tensors)
        keys = worker.keys(np.random.default_rng(32).integers(0, 150_000, 32768).tolist())
        dst = range(pages, 2 * pages)
        walls: list[Wall] = []
        for _ in range(rounds):
            forget(worker, keys, address)
            torch.cuda.synchronize()
            _wall(walls, "32k store", lambda: worker.store(keys=keys, kv_rows=range(pages),
                                                           checkpoints={32768: 0}))
            _wall(walls, "32k load, device", lambda: worker.load(keys=keys, kv_rows=dst, slot=1))
            time.sleep(0.5)
            worker.evict(keys=keys, tier=Tier.DEVICE)
            _wall(walls, "32k load, host", lambda: worker.load(keys=keys, kv_rows=dst, slot=1))
        worker.close()
        return walls
    return calls


def print_profile() -> None:
    host_only = ("--host-budget", "3GiB", "--device-budget", "0", "--no-disk")
    with_device = ("--host-budget", "4GiB", "--device-budget", "4GiB", "--no-disk")
    for title, args, calls in ((f"{TOTAL // MiB} MiB in 4 KiB rows", host_only, _rows_calls(4096)),
                               (f"{TOTAL // MiB} MiB in 1 MiB rows", host_only, _rows_calls(1 << 20)),
                               ("32k-token Qwen3-Next-shaped prefix", with_device, _prefix_calls())):
        for sync in (True, False):
            found, lines, empty_ms = _traced(args, calls, sync)
            labels = list(found)
            steps = sorted({k for f in found.values() for k in f},
                           key=lambda k: (k == "total", k == "worker wall", k))
            how = ("steps synchronised with the GPU" if sync else
                   "not synchronised: the CPU's time in each step, a fence's wait for the GPU")
            rows = [(k, *(found[label].get(k, 0.0) for label in labels)) for k in steps]
            rows.append(("empty RPC (health)", *(empty_ms,) * len(labels)))
            print_table(f"where the time goes: {title} (ms, median of 5; {how})", ["step", *labels], rows)
            if not sync:  # synchronised steps would stretch the timeline
                events = sorted({k for line in lines.values() for k in line},  # by when; the
                                key=lambda k: (k == "GPU copying (sum)",  # sum, a span, last
                                               min(line.get(k, np.inf) for line in lines.values())))
                print_table(f"when, on the worker's clock: {title} (ms after the worker's call "
                            "starts, median of 5)", ["event", *labels],
                            [(k, *(lines[label].get(k, "-") for label in labels)) for k in events])
    print_copy_alone()
    print_beside_compute()


def print_beside_compute(rounds: int = 5) -> None:
    """What a copy between the worker and host slots costs the worker's own kernels: 12
    bf16 matmuls of 8192^3 on a stream of the worker's, alone and beside a 512 MiB load
    or store in 4 KiB rows (slots in one run) by the Triton launch reading or writing
    host memory itself, or staged through CudaTransfer's ring (CUDA events, medians)."""
    from tiercache.tiers.host import HostMemory
    from tiercache.transfer import CudaTransfer
    memory, transfer = HostMemory(pin=True), CudaTransfer.open(torch.device("cuda"))
    row_bytes, pages = 4096, TOTAL // (BUFFERS * 4096)
    buffers = [torch.zeros((2 * pages, row_bytes), dtype=torch.uint8, device="cuda") for _ in range(BUFFERS)]
    offsets = [b * row_bytes for b in range(BUFFERS)]
    slots = memory.allocate(pages, BUFFERS * row_bytes)
    rows, part = torch.randperm(2 * pages)[:pages].numpy(), SlabPart(slots, np.arange(pages), np.arange(pages))
    addresses = slots.data_ptr() + np.arange(pages, dtype=np.int64) * slots.stride(0)
    table, _ = transfer._table(buffers, offsets)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    worker = torch.cuda.Stream()

    def copy(direction: str, staged: bool) -> None:
        if not staged:
            transfer._run(table, rows, addresses, direction == "store", direction)
        elif direction == "store":
            transfer.gather(buffers, offsets, rows, [part])
        else:
            transfer.scatter([part], buffers, offsets, rows)

    def matmuls_ms(beside: Callable[[], None] | None) -> float:
        torch.cuda.synchronize()
        with torch.cuda.stream(worker):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(12):
                a @ b
            end.record()
        if beside is not None:
            beside()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    out = []
    for direction in ("load", "store"):
        ms = {how: [] for how in ("alone", "launch", "staged")}
        for _ in range(rounds + 1):  # the first round warms up
            for how in ms:
                ms[how].append(matmuls_ms(None if how == "alone" else
                                          lambda: copy(direction, how == "staged")))
        alone = float(np.median(ms["alone"][1:]))
        out.append((direction, alone, *(float(np.median(ms[how][1:])) / alone for how in ("launch", "staged"))))
    memory.release(slots)
    memory.close()
    print_table("the worker's kernels beside a copy: 12 bf16 matmuls of 8192^3 on the worker's stream, "
                "alone and beside 512 MiB in 4 KiB rows to or from host slots (CUDA events, median of "
                f"{rounds})", ["copy", "matmuls alone ms", "beside the launch / alone",
                               "beside the staged copy / alone"], out)


def print_copy_alone() -> None:
    """The copy alone, beside a bulk copy, all timed by CUDA events: 512 MiB of rows of
    the benchmark's buffers to and from page-locked slots from cudaHostAlloc (as the host
    tier's), by the Triton kernel and by the copy engines (copy_engines.py; rows under 64
    KiB not tried: the driver's work per row makes them slow), and by the path
    CudaTransfer picks (the engines for rows of copy_engines.MIN_ROW_BYTES and more,
    shorter rows staged through its ring of device memory: slots here lie in one run),
    with the CPU time it takes to queue a load."""
    from tiercache import copy_engines
    from tiercache.kernels import BufferTable, copy_rows
    from tiercache.tiers.host import HostMemory
    from tiercache.transfer import CudaTransfer
    memory, rows_out = HostMemory(pin=True), []
    transfer = CudaTransfer.open(torch.device("cuda"))
    stream = transfer.streams[0]
    for row_bytes in (4096, 16384, 65536, 1 << 17, 1 << 18, 1 << 19, 1 << 20):
        pages = TOTAL // (BUFFERS * row_bytes)
        buffers = [torch.zeros((2 * pages, row_bytes), dtype=torch.uint8, device="cuda")
                   for _ in range(BUFFERS)]
        slots = memory.allocate(pages, BUFFERS * row_bytes)
        table = BufferTable.of(buffers, [b * row_bytes for b in range(BUFFERS)], torch.device("cuda"))
        order = torch.randperm(2 * pages)[:pages]
        rows = order.cuda()
        host_rows = order.numpy()
        host_addresses = slots.data_ptr() + np.arange(pages, dtype=np.int64) * slots.stride(0)
        addresses = torch.from_numpy(host_addresses).cuda()
        worker, slot, sizes = copy_engines.row_addresses(table.host, host_rows, host_addresses)
        flat = slots.view(-1)
        device = torch.empty(flat.numel(), dtype=torch.uint8, device="cuda")

        def timed(fn: Callable[[], None]) -> float:
            times = []
            for _ in range(11):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record(stream)
                    fn()
                    end.record(stream)
                end.synchronize()
                times.append(start.elapsed_time(end))
            return float(np.median(times[2:]))
        h2d = timed(lambda: device.copy_(flat, non_blocking=True))
        d2h = timed(lambda: flat.copy_(device, non_blocking=True))
        kernel = (h2d / timed(lambda: copy_rows(table, rows, addresses, False)),
                  d2h / timed(lambda: copy_rows(table, rows, addresses, True)))
        engines: tuple = ("-", "-")
        if row_bytes >= 65536:
            engines = (h2d / timed(lambda: copy_engines.copy(worker, slot, sizes, stream)),
                       d2h / timed(lambda: copy_engines.copy(slot, worker, sizes, stream)))
        part, offsets = SlabPart(slots, np.arange(pages), np.arange(pages)), [b * row_bytes for b in range(BUFFERS)]

        def through(direction: str, copy: Callable[[], None]) -> Callable[[], None]:
            """CudaTransfer's own path, on its streams, between events of `stream`."""
            def run() -> None:
                begin = torch.cuda.Event()
                begin.record(stream)
                for other in transfer.streams:
                    other.wait_event(begin)
                copy()
                stream.wait_event(transfer.fence(direction))
            return run
        load = through("load", lambda: transfer.scatter([part], buffers, offsets, host_rows))
        ours = (h2d / timed(load),
                d2h / timed(through("store", lambda: transfer.gather(buffers, offsets, host_rows, [part]))))
        queued = []
        for _ in range(21):
            start = time.perf_counter()
            transfer.scatter([part], buffers, offsets, host_rows)
            queued.append((time.perf_counter() - start) * 1e3)
            transfer.synchronize()
        rows_out.append((f"{row_bytes // 1024}k", kernel[0], engines[0], ours[0], kernel[1], engines[1],
                         ours[1], h2d, d2h, float(np.median(queued[3:]))))
        memory.release(slots)
        del buffers, device
    memory.close()
    print_table(f"the copy alone, {TOTAL // MiB} MiB, {BUFFERS} buffers <-> cudaHostAlloc slots: ratio to "
                "a bulk copy (CUDA events, median of 9)",
                ["rows", "load, kernel", "load, engines", "load, CudaTransfer", "store, kernel",
                 "store, engines", "store, CudaTransfer", "bulk h2d ms", "bulk d2h ms",
                 "CPU ms to queue a load (CudaTransfer)"], rows_out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true", help="also the per-step breakdown")
    parser.add_argument("--daemon-cpus", type=int, default=0, metavar="N",
                        help="the daemons on the first N CPUs, kept out of idle; this process on the rest")
    parser.add_argument("--no-lanes", action="store_true",
                        help="each Match, Load and Store a message of the worker's stream of calls, "
                             "not of its lane")
    parser.add_argument("--unary-calls", action="store_true",
                        help="each Match, Load and Store a call of its own")
    args = parser.parse_args()
    CLIENT["streamed_calls"] = not args.unary_calls
    CLIENT["lanes"] = not (args.no_lanes or args.unary_calls)
    if args.profile:
        print_profile()
    rows, summary = [], {}
    with daemon(args.daemon_cpus, "--host-budget", "3GiB", "--device-budget", "0", "--no-disk") as address:
        for row_bytes in (4096, 16384, 65536, 1 << 20):
            load_s, waited_s, store_s, naive_load, naive_store = ours(address, row_bytes)
            # the peer right beside each row size (once at the start, it ran while the
            # daemon was still page-locking its memory: 35 instead of 54 GB/s one run)
            h2d, d2h = bulk(TOTAL)
            gbs = lambda s: TOTAL / s / 1e9  # noqa: E731
            label = f"{row_bytes // 1024}k"
            rows.append((label, gbs(load_s), gbs(waited_s), gbs(naive_load), gbs(h2d), h2d / load_s,
                         gbs(store_s), gbs(naive_store), gbs(d2h), d2h / store_s))
            summary[f"load_vs_bulk_{label}"] = h2d / load_s
            summary[f"load_waited_vs_bulk_{label}"] = h2d / waited_s
            summary[f"store_vs_bulk_{label}"] = d2h / store_s
    with daemon(args.daemon_cpus, "--host-budget", "4GiB", "--device-budget", "4GiB", "--no-disk") as address:
        summary.update(prefix_32k(address))
    print_table(f"{TOTAL // MiB} MiB of scattered rows, {BUFFERS} buffers, worker <-> daemon host tier",
                ["rows", "load GB/s", "waited", "per-row", "bulk h2d", "ratio", "store GB/s", "per-row",
                 "bulk d2h", "ratio"], rows)
    print_summary(**summary)


if __name__ == "__main__":
    main()
