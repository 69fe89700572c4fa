"""Store and load 64 MiB of rows through the daemon and shared memory, beside a plain
memcpy of the same bytes.

The worker (this process) keeps its buffers in POSIX shared memory; the daemon (another
process) copies rows from them into its host tier on Store, and from its host tier into
other rows on Load. Layout: 24 paged buffers with 16 KiB rows (a Qwen3-Next-shaped page
of 384 KiB), rows scattered. Peer: one memcpy of 64 MiB in this process (ctypes.memmove,
single-threaded, warm buffers).
"""

from __future__ import annotations

import ctypes
import tempfile

import numpy as np
import torch

from benchmarks.common import median_seconds, print_summary, print_table
from tiercache_service.process import spawn
from tiercache.client import Client
from tiercache.layout import BufferSpec, Layout

MiB = 1 << 20
PAGES = 64 * MiB // (24 * 16 * 1024)  # 170 pages of 384 KiB
LAYOUT = Layout(16, paged=tuple(BufferSpec(f"{kv}{i}", 2 * PAGES + 2, (16, 2, 256), "bfloat16")
                                for i in range(12) for kv in "kv"))


def memcpy_seconds(nbytes: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 1
    return median_seconds(lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes), repeat=9)


def main() -> None:
    nbytes = PAGES * LAYOUT.page_bytes
    copy_s = memcpy_seconds(nbytes)
    rng = np.random.default_rng(1)
    order = rng.permutation(LAYOUT.page_rows).tolist()
    src_rows, dst_rows = order[:PAGES], order[PAGES:2 * PAGES]  # scattered, disjoint
    tokens = rng.integers(0, 150_000, PAGES * 16).tolist()
    with spawn(tempfile.mkdtemp(prefix="tiercache-bench-"), "--host-budget", "512MiB",
               "--no-disk") as (address, _):
        worker = Client(address).register("bench-model", LAYOUT)
        for tensor in worker.paged.values():
            tensor.view(torch.int16).copy_(torch.randint(-30000, 30000, tensor.shape, dtype=torch.int16))
        keys = worker.keys(tokens)

        def store():
            assert worker.store(keys=keys, kv_rows=src_rows).stored == PAGES
        store_s = median_seconds(store, repeat=9, setup=lambda: worker.evict(keys=keys))
        load_s = median_seconds(lambda: worker.load(keys=keys, kv_rows=dst_rows), repeat=9)
        raw = [t.view(torch.int16) for t in worker.paged.values()]  # bf16 bits: NaN != NaN
        assert all(torch.equal(t[dst_rows], t[src_rows]) for t in raw)
        worker.close()
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    print_table(f"{nbytes / MiB:.0f} MiB of rows through the daemon ({PAGES} pages of 384 KiB)",
                ["path", "GB/s", "memcpy GB/s", "ratio"],
                [("store (rows -> daemon)", gbs(store_s), gbs(copy_s), copy_s / store_s),
                 ("load (daemon -> rows)", gbs(load_s), gbs(copy_s), copy_s / load_s)])
    print_summary(store_vs_memcpy=copy_s / store_s, load_vs_memcpy=copy_s / load_s,
                  both_vs_memcpy=2 * copy_s / (store_s + load_s))


if __name__ == "__main__":
    main()
