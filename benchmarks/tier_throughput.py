"""Store and load 256 MiB of KV pages through the host tier and through LMDB.

Peers, measured in the same run on the same bytes: for the host tier (worker rows to
host slots and back), one plain torch `copy_` of 256 MiB; for LMDB (host slots to LMDB
with fsync, and back with every checksum checked), writing the bytes to a plain file with
fsync and reading them back. A whole load from LMDB into worker rows is shown too. The layout is Qwen3-Next-shaped: 24 paged buffers (12 attention layers x K, V)
with 16 KiB rows (16 tokens x 2 KV heads x 256 dims in bf16), so a page is 384 KiB, and
the worker's rows are scattered over a pool twice the size.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import torch

from benchmarks.common import median_seconds, print_summary, print_table
from tiercache.buffers import WorkerBuffers
from tiercache.engine import Engine, EngineConfig
from tiercache.hashing import Namespace, page_keys
from tiercache.results import Tier
from tiercache.layout import BufferSpec, Layout
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig

MiB = 1 << 20
TOTAL = 256 * MiB
LAYOUT_ROWS = 2 * (TOTAL // (24 * 16 * 1024)) + 2


def make_layout() -> Layout:
    return Layout(16, paged=tuple(BufferSpec(f"{kv}{i}", LAYOUT_ROWS, (16, 2, 256), "bfloat16")
                                  for i in range(12) for kv in "kv"))


def make_worker(layout: Layout, seed: int) -> WorkerBuffers:
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-30000, 30000, s.shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)
               for s in layout.paged]
    return WorkerBuffers.bind(layout, tensors)


def host_figures(layout, keys, src_rows, dst_rows):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=TOTAL + 64 * MiB)))
    source, dest = make_worker(layout, 1), make_worker(layout, 2)

    def store():
        assert engine.store_pages(source, keys, src_rows).stored == len(keys)
    store_s = median_seconds(store, repeat=5, setup=engine.evict)
    load_s = median_seconds(lambda: engine.load(dest, keys, dst_rows), repeat=5)
    assert all(torch.equal(d[dst_rows], s[src_rows]) for d, s in zip(dest.paged, source.paged))
    engine.close()
    return store_s, load_s


def disk_figures(layout, keys, src_rows, dst_rows, folder):
    """The disk tier's own path: host slots -> LMDB (flush) and LMDB -> host slots
    (prefetch), plus a whole load from disk into worker rows for reference."""
    config = EngineConfig(host=HostConfig(budget_bytes=TOTAL + 64 * MiB),
                          disk=DiskConfig(os.path.join(folder, "lmdb"), map_size=2 * TOTAL + 64 * MiB))
    source, dest = make_worker(layout, 1), make_worker(layout, 2)
    engine = Engine.open(config)
    engine.store_pages(source, keys, src_rows)

    def store():  # host -> LMDB in one transaction, fsynced
        assert engine.flush() == len(keys)

    def promote():  # LMDB -> checksum -> host slots
        assert engine.prefetch(layout, keys) == len(keys)

    def load():  # LMDB -> checksum -> host slots -> worker rows
        assert engine.load(dest, keys, dst_rows).bytes_from == {Tier.DISK: len(keys) * layout.page_bytes}
    figures = [median_seconds(store, repeat=3, setup=lambda: engine.evict(tier=Tier.DISK)),
               median_seconds(promote, repeat=3, setup=lambda: engine.evict(tier=Tier.HOST)),
               median_seconds(load, repeat=3, setup=lambda: engine.evict(tier=Tier.HOST))]
    assert all(torch.equal(d[dst_rows], s[src_rows]) for d, s in zip(dest.paged, source.paged))
    engine.close(flush=False)
    return figures


def file_figures(nbytes, folder):
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    back = np.empty_like(data)
    path = os.path.join(folder, "plain.bin")

    def write():
        with open(path, "wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())

    def read():
        with open(path, "rb") as f:
            f.readinto(memoryview(back))
    write_s = median_seconds(write, repeat=3)
    read_s = median_seconds(read, repeat=3)
    assert np.array_equal(back, data)
    return write_s, read_s


def copy_seconds(nbytes):
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return median_seconds(lambda: dst.copy_(src), repeat=7)


TOTAL_PAGES = TOTAL // (24 * 16 * 1024)


def main() -> None:
    layout = make_layout()
    keys = page_keys(np.arange(TOTAL_PAGES * 16) % 150_000, Namespace("bench", layout.fingerprint).root(), 16)
    rng = np.random.default_rng(0)
    src_rows, dst_rows = (rng.permutation(LAYOUT_ROWS)[:TOTAL_PAGES] for _ in range(2))
    nbytes = TOTAL_PAGES * layout.page_bytes
    folder = tempfile.mkdtemp(prefix="tiercache-bench-")
    try:
        copy_s = copy_seconds(nbytes)
        host_store, host_load = host_figures(layout, keys, src_rows, dst_rows)
        disk_store, disk_load, disk_to_worker = disk_figures(layout, keys, src_rows, dst_rows, folder)
        file_write, file_read = file_figures(nbytes, folder)
    finally:
        shutil.rmtree(folder)
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    print_table(f"{nbytes / MiB:.0f} MiB of pages ({layout.page_bytes // 1024} KiB each, 24 buffers)",
                ["path", "ours GB/s", "peer", "peer GB/s", "ratio"],
                [("host store", gbs(host_store), "torch copy_", gbs(copy_s), copy_s / host_store),
                 ("host load", gbs(host_load), "torch copy_", gbs(copy_s), copy_s / host_load),
                 ("lmdb store", gbs(disk_store), "file write+fsync", gbs(file_write), file_write / disk_store),
                 ("lmdb load", gbs(disk_load), "file read", gbs(file_read), file_read / disk_load),
                 ("lmdb -> rows", gbs(disk_to_worker), "file read", gbs(file_read), file_read / disk_to_worker)])
    print_summary(host_vs_copy=2 * copy_s / (host_store + host_load),
                  host_store_vs_copy=copy_s / host_store, host_load_vs_copy=copy_s / host_load,
                  lmdb_vs_file=(file_write + file_read) / (disk_store + disk_load),
                  lmdb_store_vs_file=file_write / disk_store, lmdb_load_vs_file=file_read / disk_load,
                  lmdb_to_rows_vs_file=file_read / disk_to_worker)


if __name__ == "__main__":
    main()
