"""A GPU worker for the fault tests (tests/gpu/test_gpu_faults.py), in its own process.

    python -m tests.gpu.fault_worker load ADDRESS SEED        # store, then a load the test kills
    python -m tests.gpu.fault_worker recompute ADDRESS SEED   # store, load; if the load fails, recompute
    python -m tests.gpu.fault_worker replied ADDRESS SEED     # an async load that replies before its copy
    python -m tests.gpu.fault_worker ahead ADDRESS SEED       # a load behind seconds of GPU work
    python -m tests.gpu.fault_worker lost ADDRESS SEED        # a load whose reply comes too late
    python -m tests.gpu.fault_worker stuck ADDRESS SEED       # async calls queued, then killed
    python -m tests.gpu.fault_worker posted ADDRESS SEED      # a post queued, then the daemon killed

`load`: stores one prompt, prints "stored", starts a load into other rows, prints
"loading" and waits in it (the daemon holds loads in a failpoint) until the test kills
this process. `recompute`: the same, but when the load fails (the test killed the
daemon) it computes the rows itself, checks its GPU still works and that the rows hold
what they should, and prints "recomputed ok" (or "bad ..."). `replied`: queues a long
kernel, records the ready event after it, so the daemon's copy waits behind it while the
load replies at once; prints "replied"; the test kills the daemon; then it waits for its
stream (at most 60 s) and prints "stream done" or "stream hung", and whether the rows
got the bytes. `ahead`: stores, then a load whose copies wait behind 8 s of its own GPU
work (the daemon's load stream with them); prints "loading" first, and stays until told
to end. `lost`: registers, prints "ready", and when told, a load (of the prompt `ahead`
stored) whose copies the daemon queues behind those, and whose reply the daemon holds
past this worker's deadline; told the load failed, the worker writes the rows itself at
once on its stream, and prints "own rows" if they hold its writes once the daemon's
copies are done (its stream waited for them), else "bad ...". `stuck`: stores one prompt,
queues 30 s of GPU work, then an asynchronous load of that prompt and an asynchronous
store of another, both replied with their copies waiting behind that work; prints
"queued" and waits for the test to kill it. `posted`: a post through an outbox whose copies
wait behind seconds of GPU work; prints "posted" once the daemon replied; the test kills the
daemon and says go on; then a second post, which must be refused, and the stream and
`close` must end (each within 60 s): prints "refused", "stream done" and "closed", or what
went wrong.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from tests.gpu.gpu_worker import PAGES, bits, layout, prompt, register, sleep_gpu
from tiercache.errors import DeadlineExceeded, TiercacheError

ROWS = list(range(PAGES, 2 * PAGES))


def poison(tensors, value: int) -> None:
    """Overwrite the rows a load would fill (kv rows PAGES.., state slot 1)."""
    for i in range(4):
        bits(tensors[f"kv{i}"])[PAGES:2 * PAGES].fill_(value)
    bits(tensors["state"])[1].fill_(value)


def stored(address: str, seed: int):
    worker, tensors = register(address, layout(1 << 16, 4, rows=2 * PAGES), seed)
    source = {name: bits(t).clone() for name, t in tensors.items()}
    worker.store(prompt(0), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0})
    torch.cuda.synchronize()
    print("stored", flush=True)
    return worker, tensors, source


def rows_right(tensors, source) -> bool:
    return all(torch.equal(bits(tensors[f"kv{i}"])[ROWS], source[f"kv{i}"][:PAGES])
               for i in range(4)) and torch.equal(bits(tensors["state"])[1], source["state"][0])


def load(address: str, seed: int) -> None:
    worker, _, _ = stored(address, seed)
    print("loading", flush=True)
    worker.load(prompt(0), kv_rows=ROWS, slot=1)  # held by the daemon until we are killed
    print("load returned", flush=True)


def recompute(address: str, seed: int) -> None:
    worker, tensors, source = stored(address, seed)
    poison(tensors, 0xA5)
    print("loading", flush=True)
    try:
        worker.load(prompt(0), kv_rows=ROWS, slot=1)
        print("bad: the load succeeded although the daemon was killed", flush=True)
        return
    except TiercacheError as error:
        print(f"load failed: {error}", flush=True)
    # the prefill the load would have saved: here, the bytes the prompt's rows hold
    for i in range(4):
        bits(tensors[f"kv{i}"])[ROWS] = source[f"kv{i}"][:PAGES]
    bits(tensors["state"])[1] = source["state"][0]
    torch.cuda.synchronize()  # the GPU is fine: nothing of the daemon's is pending here
    print("recomputed ok" if rows_right(tensors, source) else "bad rows", flush=True)


def replied(address: str, seed: int) -> None:
    worker, tensors, source = stored(address, seed)
    poison(tensors, 0)
    torch.cuda._sleep(5_000_000_000)  # seconds of GPU time ahead of the ready event
    result = worker.load(prompt(0), kv_rows=ROWS, slot=1)  # replies with the copy queued
    print(f"replied {result.match.pages}", flush=True)
    sys.stdin.readline()  # the test kills the daemon, then says go on
    done = threading.Event()
    threading.Thread(target=lambda: (torch.cuda.current_stream().synchronize(), done.set()),
                     daemon=True).start()
    if not done.wait(60):
        print("stream hung", flush=True)
        return
    print("stream done; rows " + ("loaded" if rows_right(tensors, source) else "not loaded"),
          flush=True)


def ahead(address: str, seed: int) -> None:
    worker, _, _ = stored(address, seed)
    sleep_gpu(8)
    print("loading", flush=True)
    worker.load(prompt(0), kv_rows=ROWS, slot=1)  # its copies wait for the 8 s of work
    sys.stdin.readline()


def lost(address: str, seed: int) -> None:
    worker, tensors = register(address, layout(1 << 16, 4, rows=2 * PAGES), seed, timeout=2)
    print("ready", flush=True)
    sys.stdin.readline()  # the test says when the other worker's load is queued
    try:  # its copies queue behind the other worker's; its reply comes too late
        worker.load(prompt(0), kv_rows=ROWS, slot=1)
        print("bad: the load replied in time", flush=True)
        return
    except DeadlineExceeded:
        pass
    poison(tensors, 0xA5)  # the worker's own writes, right after the failure
    torch.cuda.synchronize()
    time.sleep(10)  # the other worker's GPU work is done, and the daemon's copies after it
    mine = all(bool((bits(tensors[f"kv{i}"])[ROWS] == 0xA5).all()) for i in range(4))
    mine &= bool((bits(tensors["state"])[1] == 0xA5).all())
    print("own rows" if mine else "bad: the daemon's copies landed after the worker's writes",
          flush=True)


def stuck(address: str, seed: int) -> None:
    worker, _, _ = stored(address, seed)
    sleep_gpu(30)
    worker.load(prompt(0), kv_rows=ROWS, slot=1)
    worker.store(prompt(1), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0})
    print("queued", flush=True)
    sys.stdin.readline()


def posted(address: str, seed: int) -> None:
    worker, _ = register(address, layout(1 << 16, 4, rows=2 * PAGES), seed, outbox_pages=PAGES)
    torch.cuda._sleep(10_000_000_000)  # seconds of GPU time ahead of the copy in
    first = worker.post(prompt(0), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0})
    print(f"posted {first.result(timeout=60).stored}", flush=True)  # its copies still queued
    sys.stdin.readline()  # the test kills the daemon, then says go on
    time.sleep(1)
    try:
        worker.post(prompt(1), kv_rows=range(PAGES)).result(timeout=60)
        print("bad: a post after the daemon died was stored", flush=True)
    except TiercacheError as error:
        print(f"refused: {type(error).__name__}", flush=True)
    for what, step in (("stream done", torch.cuda.current_stream().synchronize), ("closed", worker.close)):
        ended = threading.Event()
        threading.Thread(target=lambda: (step(), ended.set()), daemon=True).start()
        print(what if ended.wait(60) else f"bad: {what} hung", flush=True)


if __name__ == "__main__":
    mode, address, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    {"load": load, "recompute": recompute, "replied": replied, "ahead": ahead,
     "lost": lost, "stuck": stuck, "posted": posted}[mode](address, seed)
