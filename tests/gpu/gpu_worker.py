"""A GPU worker in its own process, driven by tests/gpu.

    python -m tests.gpu.gpu_worker roundtrip ADDRESS SEED ROW_BYTES BUFFERS PROMPTS
    python -m tests.gpu.gpu_worker stream ADDRESS SEED
    python -m tests.gpu.gpu_worker hold ADDRESS SEED

roundtrip: CUDA buffers filled from SEED; PROMPTS prompts stored from some rows (with a
checkpoint each) and loaded into other, poisoned rows; prints "ok PAGES TIERS" or "bad".
stream: a large asynchronous load, read at once by a kernel on the same stream with no
host synchronisation in between; prints "ok" if the kernel saw the loaded bytes.
reuse: stores that return with their copies queued, each followed at once by new
writes to the rows it read; prints "ok" if every entry holds the bytes from before.
behind: the first store and load a fresh daemon makes, each queued behind seconds of
the worker's GPU work; prints "ok" if both returned before that work was done and the
load brought the stored bytes.
unanswered: calls that copy nothing (a miss, refusals by the daemon and by the client, a
store of entries cached already); prints "ok" if the stream waits on none of them and a
round trip after them is exact.
posted: stores through an outbox (Worker.post) of rows of several widths, each followed at
once by new writes to its rows, two at a time, one queued behind seconds of the worker's
GPU work; prints "ok" if every entry holds the bytes from before, no post waited on the
host, a prompt larger than the outbox was stored as `store` does, and bad posts (and any
post once the worker is closed) were refused.
post_load: loads sent with post_load, each queued behind seconds of the worker's GPU work
that rewrites its rows, then read at once by a kernel on the same stream; a miss and a
load the daemon refuses, also posted; prints "ok" if every post returned before that
work was done, the kernels saw the loaded bytes (not the rewrites), the futures held
the results and the refusal, and the stream waits on none of the failed posts.
slow: an asynchronous store queued behind 6 s of GPU work; prints "replied", ends when told.
two_gpus: workers on two GPUs loading each other's stores (needs two GPUs); prints "ok".
hold: stores one prompt, prints "stored", then waits to be killed.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

from tiercache.client import Client
from tiercache.errors import TiercacheError
from tiercache.layout import BufferSpec, Layout

PAGES = 8


def layout(row_bytes: int, buffers: int, rows: int) -> Layout:
    return Layout(16, paged=tuple(BufferSpec(f"kv{i}", rows, (row_bytes // 2,), "bfloat16")
                                  for i in range(buffers)),
                  slots=(BufferSpec("state", 8, (row_bytes // 4,), "float32"),))


def register(address: str, shape: Layout, seed: int, timeout: float = 30.0, device: str = "cuda",
             **options):
    """A worker of `layout`'s shape with buffers on `device` filled from `seed`; `options`
    go to Client.register (an outbox)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {b.name: torch.randint(-2**15, 2**15, b.shape, dtype=torch.int16, device=device,
                                     generator=gen).view(torch.bfloat16) for b in shape.paged}
    tensors["state"] = torch.randn(shape.slots[0].shape, device=device, generator=gen)
    worker = Client(address, timeout=timeout).register("gpu-test", shape, buffers=tensors, **options)
    return worker, tensors


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(tensor.shape[0], -1).view(torch.uint8)


def prompt(n: int) -> list[int]:
    return np.random.default_rng(500 + n).integers(0, 150_000, PAGES * 16).tolist()


def roundtrip(address: str, seed: int, row_bytes: int, buffers: int, prompts: int) -> None:
    shape = layout(row_bytes, buffers, rows=2 * PAGES * prompts)
    worker, tensors = register(address, shape, seed)
    source = {name: bits(t).clone() for name, t in tensors.items()}
    for n in range(prompts):
        worker.store(prompt(n), kv_rows=range(n * PAGES, (n + 1) * PAGES), checkpoints={PAGES * 16: n % 4})
    for t in tensors.values():
        bits(t).fill_(0xA5)
    tiers, good = set(), True
    for n in reversed(range(prompts)):  # newest first: host hits, then disk hits
        rows = list(range(shape.page_rows - 1 - n * PAGES, shape.page_rows - 1 - (n + 1) * PAGES, -1))
        result = worker.load(prompt(n), kv_rows=rows, slot=4 + n % 4)
        tiers |= set(result.bytes_from)
        good &= result.match.pages == PAGES and all(
            torch.equal(bits(tensors[f"kv{i}"])[rows], source[f"kv{i}"][n * PAGES:(n + 1) * PAGES])
            for i in range(buffers)) and torch.equal(bits(tensors["state"])[4 + n % 4],
                                                     source["state"][n % 4])
    print(("ok " if good else "bad ") + " ".join(sorted(t.name for t in tiers)), flush=True)
    worker.close()


def stream(address: str, seed: int) -> None:
    shape = layout(1 << 20, 16, rows=64)  # 16 MiB a page: a load long enough to race
    worker, tensors = register(address, shape, seed)
    worker.store(prompt(0), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0})
    expected = sum(int(bits(tensors[f"kv{i}"])[:PAGES].sum()) for i in range(16))
    torch.cuda.synchronize()
    for t in tensors.values():
        bits(t)[PAGES:].fill_(0)
    torch.cuda.synchronize()
    rows = list(range(PAGES, 2 * PAGES))
    result = worker.load(prompt(0), kv_rows=rows, slot=1)  # returns with the stream waiting
    assert result.done is not None, "a GPU load hands back its event"
    # queued on the current stream right away: it must see the loaded bytes
    seen = torch.stack([bits(tensors[f"kv{i}"])[rows].sum(dtype=torch.int64) for i in range(16)]).sum()
    print("ok" if int(seen) == expected else f"bad {int(seen)} != {expected}", flush=True)
    worker.close()


def ordered(address: str, seed: int) -> None:
    """Stores queued right behind the writes of their rows and asynchronous loads read
    right behind their return, without a host sync, six times: each store's copy must
    come after the writes and each read after the load's copy (the client reuses its
    ready events, the daemon its done events, four in turn: each record must count)."""
    shape = layout(1 << 16, 4, rows=64)
    worker, tensors = register(address, shape, seed)
    good, rows = True, list(range(PAGES, 2 * PAGES))
    source = {name: slice(0, PAGES) if name != "state" else slice(0, 1) for name in tensors}
    target = {name: slice(PAGES, 2 * PAGES) if name != "state" else slice(1, 2) for name in tensors}
    for n in range(6):
        torch.cuda._sleep(200_000_000)  # ~0.1 s on the stream: the writes below land late
        for name, t in tensors.items():
            bits(t)[source[name]].fill_(n + 1)
        worker.store(prompt(10 + n), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0})
        for name, t in tensors.items():
            bits(t)[target[name]].fill_(0)
        result = worker.load(prompt(10 + n), kv_rows=rows, slot=1)  # the stream waits
        good &= result.done is not None and all(bool((bits(t)[target[name]] == n + 1).all()) for name, t in tensors.items())
    print("ok" if good else "bad", flush=True)
    worker.close()


def reuse(address: str, seed: int) -> None:
    """Stores as workers call them by default (the reply comes once the copies are
    queued, the stream waiting on their event), each followed at once by writes to the
    same rows on the same stream, with no host sync: the entries must hold the bytes
    from before those writes, and a load right after the reply must find them all."""
    shape = layout(1 << 20, 16, rows=64)  # 16 MiB a page: copies that take long enough to race
    worker, tensors = register(address, shape, seed)
    good, rows = True, list(range(PAGES, 2 * PAGES))
    source = {name: slice(0, PAGES) if name != "state" else slice(0, 1) for name in tensors}
    target = {name: slice(PAGES, 2 * PAGES) if name != "state" else slice(1, 2) for name in tensors}
    for n in range(4):
        for name, t in tensors.items():
            bits(t)[source[name]].fill_(n + 1)
        stored = worker.store(prompt(20 + n), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0})
        for name, t in tensors.items():  # written again at once: after the copies, or wrong
            bits(t)[source[name]].fill_(0xEE)
        result = worker.load(prompt(20 + n), kv_rows=rows, slot=1)
        good &= stored.stored == PAGES + 1 and result.match.pages == PAGES and all(
            bool((bits(t)[target[name]] == n + 1).all()) for name, t in tensors.items())
    print("ok" if good else "bad", flush=True)
    worker.close()


def behind(address: str, seed: int) -> None:
    """A daemon's first launch of a kernel loads it into the GPU's context, which waits
    for the copies queued there, and so for the worker work they wait for: done at
    registration, a worker's first store and load return with their copies queued."""
    shape = layout(16384, 4, rows=2 * PAGES)  # rows the copy kernel moves, in both tiers
    worker, tensors = register(address, shape, seed)
    source = {name: bits(t).clone() for name, t in tensors.items()}
    waited = []

    def behind_work(step, call):
        sleep_gpu(4)  # the worker's own work, queued before the call
        busy = torch.cuda.Event()
        busy.record()
        out = call()
        waited.extend([step] if busy.query() else [])  # the work done: the call waited for it
        torch.cuda.synchronize()
        return out

    behind_work("store", lambda: worker.store(prompt(0), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0}))
    for i in range(4):  # the rows and slot the load writes
        bits(tensors[f"kv{i}"])[PAGES:].fill_(0xA5)
    bits(tensors["state"])[1].fill_(0xA5)
    result = behind_work("load", lambda: worker.load(prompt(0), kv_rows=range(PAGES, 2 * PAGES), slot=1))
    exact = result.match.pages == PAGES and torch.equal(bits(tensors["state"])[1], source["state"][0]) and all(
        torch.equal(bits(tensors[f"kv{i}"])[PAGES:], source[f"kv{i}"][:PAGES]) for i in range(4))
    print("ok" if exact and not waited else f"bad: waited in {waited}, exact {exact}", flush=True)
    worker.close()


def unanswered(address: str, seed: int) -> None:
    """Calls whose copies never start: a load that misses, one the daemon refuses (no such
    state slot), one the client refuses before it is sent, a store of entries all cached
    already. The stream must not wait on any of them; then a round trip is still exact."""
    worker, tensors = register(address, layout(16384, 4, rows=2 * PAGES), seed)
    source = {name: bits(t).clone() for name, t in tensors.items()}
    stream = torch.cuda.current_stream()
    calls = {"miss": lambda: worker.load(prompt(90), kv_rows=range(PAGES), slot=1),
             "daemon refused": lambda: worker.load(prompt(91), kv_rows=range(PAGES), slot=99),
             "client refused": lambda: worker.load(prompt(92), kv_rows=[0, -1], slot=1),
             "stored": lambda: worker.store(prompt(0), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0}),
             "cached": lambda: worker.store(prompt(0), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0})}
    held = []
    for name, call in calls.items():
        try:
            call()
        except TiercacheError:
            pass
        started = time.time()
        while not stream.query() and time.time() - started < 10:
            time.sleep(0.01)
        held += [] if stream.query() else [name]
    if held:
        print(f"bad: the stream still waits after {held}", flush=True)
        os._exit(1)  # a held stream would hold this process's exit too
    for i in range(4):
        bits(tensors[f"kv{i}"])[PAGES:].fill_(0xA5)
    result = worker.load(prompt(0), kv_rows=range(PAGES, 2 * PAGES), slot=1)
    torch.cuda.synchronize()
    exact = result.match.pages == PAGES and torch.equal(bits(tensors["state"])[1], source["state"][0]) and all(
        torch.equal(bits(tensors[f"kv{i}"])[PAGES:], source[f"kv{i}"][:PAGES]) for i in range(4))
    print("ok" if exact else "bad: the round trip after them", flush=True)
    worker.close()


def posted(address: str, seed: int) -> None:
    shape = Layout(16, paged=(*(BufferSpec(f"kv{i}", 4 * PAGES, (8192,), "bfloat16") for i in range(4)),
                              *(BufferSpec(f"mla{i}", 4 * PAGES, (576,), "bfloat16") for i in range(2))),
                   slots=(BufferSpec("recurrent", 4, (16, 64, 64), "float32"),
                          BufferSpec("conv", 4, (1024, 3), "bfloat16")))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {b.name: torch.randint(-2**15, 2**15, b.shape, dtype=torch.int16, device="cuda",
                                     generator=gen).view(getattr(torch, b.dtype)) for b in shape.paged}
    tensors.update({b.name: torch.randn(b.shape, device="cuda", generator=gen).to(getattr(torch, b.dtype))
                    for b in shape.slots})
    worker = Client(address).register("gpu-test", shape, buffers=tensors, outbox_pages=PAGES,
                                      outbox_checkpoints=1)
    problems = []
    paged = [b.name for b in shape.paged]

    def fill(n: int) -> None:  # rows 0..PAGES-1 and state slot 0, on the current stream
        for name, t in tensors.items():
            bits(t)[slice(0, PAGES) if name in paged else slice(0, 1)].fill_(n)
    refusals = {"a row out of range": lambda: worker.post(prompt(40), kv_rows=[0, 4 * PAGES]),
                # refused once its rows were copied in: the next post still waits for that copy
                "tokens to publish without tokens": lambda: worker.post(
                    keys=worker.keys(prompt(40)), kv_rows=range(PAGES), publish_tokens=True)}
    for what, call in refusals.items():
        try:
            call()
            problems.append(f"{what} was posted")
        except TiercacheError:
            pass
    futures = []
    for n in range(1, 5):  # two posts before any answer: the second waits for the outbox on the GPU
        fill(n)
        if n == 3:
            sleep_gpu(3)  # the worker's own work, queued before the post
        began = time.monotonic()
        futures.append(worker.post(prompt(40 + n), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0}))
        if time.monotonic() - began > 1.0:
            problems.append(f"post {n} waited {time.monotonic() - began:.1f} s on the host")
        fill(0xEE)  # written again at once, in stream order: after the copy into the outbox
        if n % 2 == 0:
            results = [f.result(timeout=60) for f in futures]
            futures.clear()
            problems += [f"post stored {r.stored}" for r in results if r.stored != PAGES + 1]
    for n in range(1, 5):
        result = worker.load(prompt(40 + n), kv_rows=range(2 * PAGES, 3 * PAGES), slot=2)
        exact = result.match.pages == PAGES and all(
            bool((bits(t)[slice(2 * PAGES, 3 * PAGES) if name in paged else slice(2, 3)] == n).all())
            for name, t in tensors.items())
        problems += [] if exact else [f"prompt {n}: pages {result.match.pages}, bytes not the posted ones"]
    large = np.random.default_rng(600).integers(0, 150_000, 2 * PAGES * 16).tolist()
    stored = worker.post(large, kv_rows=range(2 * PAGES), checkpoints={2 * PAGES * 16: 1})
    problems += [] if stored.done() and stored.result().stored == 2 * PAGES + 1 else ["the large post"]
    worker.close()
    try:
        worker.post(prompt(41), kv_rows=range(PAGES))
        problems.append("a closed worker posted")
    except TiercacheError:
        pass
    print("ok" if not problems else f"bad: {problems}", flush=True)


def two_gpus(address: str, seed: int) -> None:
    """Two workers of one process on two GPUs, sharing the daemon. `near` registers first,
    on the second GPU, so the device tier goes there; `away`, on the first GPU, reads
    device entries from their host copies. `away` loads `near`'s prompts right after they
    are stored, while they may still be only on the device: each hit must be exact, a
    miss is allowed until the copies down are done, and no entry may be lost. Then `near`
    loads `away`'s stores, and its own again."""
    shape = layout(16384, 4, rows=4 * PAGES)
    near, near_t = register(address, shape, seed, device="cuda:1")
    source = {name: bits(t).cpu() for name, t in near_t.items()}
    for n in range(4):
        near.store(prompt(70 + n), kv_rows=range(n * PAGES, (n + 1) * PAGES), checkpoints={PAGES * 16: n})
    away, away_t = register(address, shape, seed + 1, device="cuda:0")
    problems, misses = [], 0

    def loaded(worker, tensors, n: int, rows: range, slot: int, want: dict, want_rows: range,
               want_slot: int) -> int:
        for t in tensors.values():
            bits(t).fill_(0xA5)
        result = worker.load(prompt(70 + n), kv_rows=rows, slot=slot)
        got = {name: bits(t).cpu() for name, t in tensors.items()}
        if result.match.pages and not (result.match.pages == PAGES and torch.equal(
                got["state"][slot], want["state"][want_slot]) and all(
                torch.equal(got[f"kv{i}"][list(rows)], want[f"kv{i}"][list(want_rows)]) for i in range(4))):
            problems.append(f"prompt {n}: {result.match.pages} pages, not the stored bytes")
        return result.match.pages

    for n in range(4):
        deadline = time.monotonic() + 10
        while not loaded(away, away_t, n, range(2 * PAGES, 3 * PAGES), 7, source,
                         range(n * PAGES, (n + 1) * PAGES), n):
            misses += 1
            if time.monotonic() > deadline:
                problems.append(f"prompt {n}: still a miss for the other GPU's worker after 10 s")
                break
    for t in away_t.values():
        bits(t).random_(0, 256)
    away_source = {name: bits(t).cpu() for name, t in away_t.items()}
    for n in (4, 5):
        away.store(prompt(70 + n), kv_rows=range(n * PAGES - 4 * PAGES, n * PAGES - 3 * PAGES),
                   checkpoints={PAGES * 16: n})
    for n in range(6):
        want, rows = (source, range(n * PAGES, (n + 1) * PAGES)) if n < 4 else (
            away_source, range((n - 4) * PAGES, (n - 3) * PAGES))
        if loaded(near, near_t, n, range(3 * PAGES, 4 * PAGES), 6, want, rows, n) != PAGES:
            problems.append(f"prompt {n}: a miss for the device tier's worker")
    near.close()
    away.close()
    print("ok" if not problems else f"bad: {problems}", f"misses {misses}", flush=True)


def post_load(address: str, seed: int) -> None:
    shape = layout(1 << 20, 16, rows=64)  # 16 MiB a page: copies long enough to race
    worker, tensors = register(address, shape, seed)
    worker.store(prompt(0), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0})
    torch.cuda.synchronize()
    source = {name: bits(t).clone() for name, t in tensors.items()}
    stream, problems = torch.cuda.current_stream(), []
    for n in range(3):
        sleep_gpu(1)  # then rewrites of the rows the load writes: the copies come after them
        for i in range(16):
            bits(tensors[f"kv{i}"])[PAGES:2 * PAGES].fill_(n + 1)
        bits(tensors["state"])[1].fill_(n + 1)
        future = worker.post_load(prompt(0), kv_rows=range(PAGES, 2 * PAGES), slot=1)
        if stream.query():
            problems.append(f"post {n} waited for the GPU work before it")
        # queued right away: must see the loaded bytes
        same = torch.stack([(bits(tensors[f"kv{i}"])[PAGES:2 * PAGES] == source[f"kv{i}"][:PAGES]).all()
                            for i in range(16)] + [(bits(tensors["state"])[1] == source["state"][0]).all()])
        result = future.result(timeout=60)
        if not bool(same.all()):
            problems.append(f"post {n}: a kernel queued after it read other bytes")
        if result.match.pages != PAGES or result.done is None:
            problems.append(f"post {n}: {result}")
    miss = worker.post_load(prompt(90), kv_rows=range(PAGES), slot=1)
    refused = worker.post_load(prompt(0), kv_rows=range(PAGES), slot=99)
    if miss.result(timeout=60).match.pages != 0:
        problems.append(f"the miss loaded {miss.result().match.pages} pages")
    if not isinstance(refused.exception(timeout=60), TiercacheError):
        problems.append(f"the refused load: {refused.exception()!r}")
    started = time.time()
    while not stream.query() and time.time() - started < 10:
        time.sleep(0.01)
    if not stream.query():
        print("bad: the stream still waits after the miss and the refusal", flush=True)
        os._exit(1)  # a held stream would hold this process's exit too
    print("ok" if not problems else f"bad: {problems}", flush=True)
    worker.close()


def slow(address: str, seed: int) -> None:
    """An asynchronous store whose copies wait behind seconds of this worker's GPU work:
    prints "replied" at once, and ends when told to."""
    worker, _ = register(address, layout(16384, 4, rows=2 * PAGES), seed)
    sleep_gpu(6)
    worker.store(prompt(0), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0})
    print("replied", flush=True)
    sys.stdin.readline()
    torch.cuda.synchronize()
    worker.close()


def hold(address: str, seed: int) -> None:
    worker, _ = register(address, layout(4096, 4, rows=16), seed)
    worker.store(prompt(0), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0})
    print("stored", flush=True)
    while True:
        time.sleep(1)


def sleep_gpu(seconds: float) -> None:
    """Queue `seconds` of GPU time on the current stream (torch's spin kernel, timed)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    per_second = 100_000_000 / (start.elapsed_time(end) / 1e3)
    for _ in range(int(seconds * per_second) // 100_000_000 + 1):
        torch.cuda._sleep(100_000_000)


if __name__ == "__main__":
    mode, address, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "roundtrip":
        roundtrip(address, seed, *map(int, sys.argv[4:7]))
    else:
        {"stream": stream, "ordered": ordered, "reuse": reuse, "behind": behind,
         "unanswered": unanswered, "slow": slow, "posted": posted, "post_load": post_load,
         "two_gpus": two_gpus}.get(mode, hold)(address, seed)
