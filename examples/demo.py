"""A daemon and two worker processes in multi-turn conversations that share a long system
prompt. Each worker matches every prompt, loads the hit into its own shared-memory rows,
"prefills" the rest, and stores what it computed. The stand-in model writes, for every
page, bytes that depend on the whole prefix (like real KV and state), so each load is
checked byte for byte against a recompute.

    make demo          (or: python examples/demo.py)
"""

from __future__ import annotations

import multiprocessing
import tempfile

import numpy as np
import torch
import xxhash

from tiercache_service.process import spawn
from tiercache.client import Client
from tiercache.layout import BufferSpec, Layout

PAGE = 16
LAYOUT = Layout(PAGE, paged=tuple(BufferSpec(f"layer{i}.{kv}", 512, (PAGE, 2, 64), "bfloat16")
                                  for i in range(4) for kv in "kv"),
                slots=(BufferSpec("gdn.state", 10, (8, 32, 32), "float32"),))
SYSTEM = np.random.default_rng(0).integers(0, 150_000, 64 * PAGE).tolist()  # 1024 shared tokens
TURNS, CONVERSATIONS = 6, 3


def page_bytes(key: bytes, nbytes: int) -> torch.Tensor:
    """What the stand-in model computes for a page: a function of its whole prefix."""
    seed = xxhash.xxh3_64_intdigest(key)
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


def rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(tensor.shape[0], -1).view(torch.uint8)


def converse(address: str, name: int, progress: multiprocessing.Queue) -> None:
    worker = Client(address).register("demo-model", LAYOUT)
    rng = np.random.default_rng(name + 1)
    for conversation in range(CONVERSATIONS):
        tokens = list(SYSTEM)
        for turn in range(TURNS):
            tokens += rng.integers(0, 150_000, int(rng.integers(40, 120))).tolist()  # the user speaks
            keys = worker.keys(tokens)
            free = list(range(len(keys)))  # this worker's page rows for the prompt
            loaded = worker.load(keys=keys, kv_rows=free, slot=0).match.pages
            for n, key in enumerate(keys):  # check the hit, "prefill" the rest
                for b, (buffer_name, tensor) in enumerate(worker.paged.items()):
                    expected = page_bytes(key + bytes([b]), rows(tensor).shape[1])
                    if n < loaded:
                        assert torch.equal(rows(tensor)[free[n]], expected), "a loaded page differs"
                    else:
                        rows(tensor)[free[n]] = expected
            state = rows(worker.slots["gdn.state"])
            if loaded:
                assert torch.equal(state[0], page_bytes(keys[loaded - 1] + b"s", state.shape[1]))
            # like a chunked prefill, the stand-in keeps its state every 16 pages (slots 1, 2,
            # ...) and at the end (slot 0), and offers them all
            offered = {len(keys) * PAGE: 0}
            for slot, pages in enumerate(range(16, len(keys), 16), start=1):
                state[slot] = page_bytes(keys[pages - 1] + b"s", state.shape[1])
                offered[pages * PAGE] = slot
            state[0] = page_bytes(keys[-1] + b"s", state.shape[1])
            worker.store(keys=keys, kv_rows=free, checkpoints=offered)
            progress.put((name, len(keys) * PAGE, loaded * PAGE))
            tokens += rng.integers(0, 150_000, 32).tolist()  # the model answers
    worker.close()
    progress.put(None)


def bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total} turns"


def main() -> None:
    with spawn(tempfile.mkdtemp(prefix="tiercache-demo-"), "--host-budget", "256MiB") as (address, _):
        print(f"tiercache listening on {address}")
        run(address)


def run(address: str) -> None:
    progress: multiprocessing.Queue = multiprocessing.Queue()
    workers = [multiprocessing.Process(target=converse, args=(address, n, progress)) for n in range(2)]
    for w in workers:
        w.start()
    total, done, finished, prompt_tokens, hit_tokens = 2 * CONVERSATIONS * TURNS, 0, 0, 0, 0
    while finished < len(workers):
        item = progress.get(timeout=300)
        if item is None:
            finished += 1
            continue
        done, prompt_tokens, hit_tokens = done + 1, prompt_tokens + item[1], hit_tokens + item[2]
        print(f"\r{bar(done, total)}  hit {hit_tokens / prompt_tokens:5.1%} of prompt tokens",
              end="", flush=True)
    for w in workers:
        w.join()
    stats = Client(address).stats()
    print(f"\n\nprompt tokens {prompt_tokens}, served from the cache {hit_tokens} "
          f"({hit_tokens / prompt_tokens:.1%}): that much prefill was skipped, and every loaded "
          "byte matched a recompute")
    for tier in stats.tiers:
        print(f"  {tier.tier.name.lower():5} {tier.entries:6} entries  {tier.used_bytes / 2**20:8.1f} MiB "
              f"of {tier.budget_bytes / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
