"""Store and load throughput of the remote tier on a real three-node Redis Cluster on
loopback, beside redis-py writing and reading the same bytes directly (the peer).

Ours: `RedisClusterStore.put` (an EXISTS round, the parts, then the sealed metadata) and
`get` (metadata and parts in one pipeline per node, every length and the checksum
checked, the bytes copied into the caller's buffer). The peer: redis-py's own
`RedisCluster.pipeline()` SETting and GETting the same parts (values of at most 16 MiB),
in batches of the same 64 MiB, with no metadata, no check and no copy: the least a
client must do to move those bytes. Entries: KV pages of 100 KiB and 1.5 MiB, and
checkpoints of 32 MiB (two parts each).

Then a lookup (what a Match adds beyond the local hit): `exists` of 1,024 entries against
one PING to every node at once (one round trip per node, the floor), and how many
pipelines it sent per node.

    python -m benchmarks.remote_tier [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from redis.cluster import RedisCluster

from benchmarks.common import median_seconds, print_summary, print_table
from tests.redis_cluster import Cluster, redis_cluster
from tiercache.buffers import WorkerBuffers
from tiercache.engine import Engine, EngineConfig
from tiercache.hashing import Namespace, page_keys
from tiercache.results import Kind
from tiercache.layout import BufferSpec, Layout
from tiercache.remote import RemoteTierConfig
from tiercache.tiers.host import HostConfig
from tiercache.tiers.remote import entry as fmt
from tiercache.tiers.remote import resp
from tiercache.tiers.remote.entry import EntryRef
from tiercache.tiers.remote.adapters import open_store
from tiercache.tiers.remote.store import Entry, RemoteConfig, Wanted

MiB, KiB = 1 << 20, 1 << 10
SIZES = (("KV page 100 KiB", 100 * KiB, Kind.PAGE), ("KV page 1.5 MiB", 1536 * KiB, Kind.PAGE),
         ("checkpoint 32 MiB", 32 * MiB, Kind.CHECKPOINT))


def make_entries(nbytes: int, total: int, kind: Kind) -> list[Entry]:
    rng = np.random.default_rng(nbytes)
    return [Entry(EntryRef(kind, os.urandom(16)), i + 1,
                  memoryview(rng.integers(0, 256, nbytes, np.uint8)))
            for i in range(max(1, total // nbytes))]


class Ours:
    """The remote tier's store and load of `entries`."""

    def __init__(self, cluster: Cluster, entries: list[Entry]) -> None:
        config = RemoteConfig(cluster.url, namespace="bench", put_seconds=120, get_seconds=120)
        self.store, self.entries = open_store(config), entries
        self.targets = [memoryview(np.empty(e.payload.nbytes, np.uint8)) for e in entries]
        self.wanted = [Wanted(e.ref, e.payload.nbytes) for e in entries]

    def put(self) -> None:
        assert self.store.put(self.entries).stored == len(self.entries)

    def get(self) -> None:
        assert all(self.store.get(self.wanted, self.targets).ok)
        assert all(np.array_equal(np.asarray(t), np.asarray(e.payload))
                   for t, e in zip(self.targets[:3], self.entries[:3]))

    def close(self) -> None:
        self.store.close()


class Peer:
    """redis-py's cluster pipeline SETting and GETting the same parts in the same batches."""

    def __init__(self, cluster: Cluster, entries: list[Entry]) -> None:
        self.client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        prefix = uuid.uuid4().hex
        self.batches = resp.batches([e.payload.nbytes for e in entries])
        self.parts = [[(f"{prefix}:{{{e.ref.key.hex()}}}:{i}", e.payload[a:b])
                       for i, (a, b) in enumerate(fmt.part_spans(e.payload.nbytes, 16 * MiB))]
                      for e in entries]

    def put(self) -> None:
        for lo, hi in self.batches:
            pipe = self.client.pipeline()
            for key, value in (p for entry in self.parts[lo:hi] for p in entry):
                pipe.set(key, value)
            assert all(pipe.execute())

    def get(self) -> None:
        for lo, hi in self.batches:
            pipe = self.client.pipeline()
            for key, _ in (p for entry in self.parts[lo:hi] for p in entry):
                pipe.get(key)
            assert all(v is not None for v in pipe.execute())

    def close(self) -> None:
        self.client.close()


def rounds(cluster: Cluster, entries: list[Entry], repeat: int) -> dict[str, float]:
    """Median seconds of each side's store and load, the sides taking turns round by
    round, so that both see the same background load."""
    sides = {"ours": Ours(cluster, entries), "peer": Peer(cluster, entries)}
    times: dict[str, list[float]] = {}
    for n in range(repeat + 1):  # the first round warms up
        for name, side in sides.items():
            _flush(cluster)
            for what, call in (("put", side.put), ("get", side.get)):
                start = time.perf_counter()
                call()
                if n:
                    times.setdefault(f"{name}_{what}", []).append(time.perf_counter() - start)
    for side in sides.values():
        side.close()
    return {k: statistics.median(v) for k, v in times.items()}


def lookup(cluster: Cluster, count: int) -> tuple[float, float, float]:
    """(seconds of exists() of `count` entries, of one PING per node at once, pipelines
    sent per node per exists())."""
    store = open_store(RemoteConfig(cluster.url, namespace="lookup", lookup_seconds=5))
    entries = make_entries(4 * KiB, count * 4 * KiB, Kind.PAGE)
    store.put(entries)
    refs = [e.ref for e in entries[: count // 2]] + [EntryRef(Kind.PAGE, os.urandom(16))
                                                      for _ in range(count - count // 2)]
    sent = []
    original = store._pipeline
    store._pipeline = lambda node, commands: (sent.append(node.name), original(node, commands))[1]
    assert sum(store.exists(refs).present) == count // 2
    per_node = len(sent) / len(set(sent))
    store._pipeline = original
    exists_s = median_seconds(lambda: store.exists(refs), repeat=21)
    nodes = [n.redis_connection for n in store._cluster.get_primaries()]
    with ThreadPoolExecutor(len(nodes)) as pool:
        ping_s = median_seconds(lambda: list(pool.map(lambda r: r.ping(), nodes)), repeat=21)
    store.close()
    return exists_s, ping_s, per_node


def engine_match(cluster: Cluster, pages: int = 1024) -> tuple[float, float, float]:
    """(seconds of a local Match of a `pages`-page prompt whose first half is local, the
    same Match consulting the remote tier for the second half, pipelines per node that
    Match sent)."""
    layout = Layout(16, paged=(BufferSpec("kv", pages, (16, 8), "bfloat16"),),
                    slots=(BufferSpec("state", 2, (64,), "float32"),))
    gen = torch.Generator().manual_seed(0)
    worker = WorkerBuffers.bind(layout, [torch.randint(0, 99, (pages, 16, 8), generator=gen).bfloat16()],
                                [torch.zeros(2, 64)])
    keys = page_keys(list(range(pages * 16)), Namespace("m", layout.fingerprint).root(), 16)
    remote = RemoteTierConfig(RemoteConfig(cluster.url, namespace="match", lookup_seconds=5))
    writer = Engine.open(EngineConfig(host=HostConfig(budget_bytes=256 * MiB), remote=remote))
    writer.store(worker, keys, list(range(pages)), checkpoints={pages: 0})
    writer.drain()
    writer.close(flush=False)
    local = Engine.open(EngineConfig(host=HostConfig(budget_bytes=256 * MiB)))
    shared = Engine.open(EngineConfig(host=HostConfig(budget_bytes=256 * MiB), remote=remote))
    for engine in (local, shared):
        engine.store(worker, keys[:pages // 2], list(range(pages // 2)),
                     checkpoints={pages // 2: 0}, remote=False)
    assert shared.match(layout, keys).pages == pages and local.match(layout, keys).pages == pages // 2
    sent: list[str] = []
    store = shared.remote.store
    original = store._pipeline
    store._pipeline = lambda node, commands: (sent.append(node.name), original(node, commands))[1]
    shared.match(layout, keys)
    store._pipeline = original
    local_s = median_seconds(lambda: local.match(layout, keys), repeat=21)
    shared_s = median_seconds(lambda: shared.match(layout, keys), repeat=21)
    local.close(flush=False), shared.close(flush=False)
    return local_s, shared_s, len(sent) / len(set(sent))


def _flush(cluster: Cluster) -> None:
    for node in cluster.nodes:
        node.cli("flushall")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 MiB a size instead of 192")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per size")
    args = parser.parse_args()
    total = (32 if args.quick else 192) * MiB
    rows, summary = [], {}
    with tempfile.TemporaryDirectory() as folder, \
            redis_cluster(Path(folder), maxmemory="2gb") as cluster:
        for name, nbytes, kind in SIZES:
            entries = make_entries(nbytes, max(total, 2 * nbytes), kind)
            moved = len(entries) * nbytes / MiB
            t = rounds(cluster, entries, args.repeat)
            our_put, our_get, peer_put, peer_get = t["ours_put"], t["ours_get"], t["peer_put"], t["peer_get"]
            rows.append((name, len(entries), f"{moved / our_put:.0f}", f"{moved / peer_put:.0f}",
                         peer_put / our_put, f"{moved / our_get:.0f}", f"{moved / peer_get:.0f}",
                         peer_get / our_get))
            tag = name.split()[0].lower() + "_" + name.split()[-2].replace(".", "_")
            summary[f"store_ratio_{tag}"] = peer_put / our_put
            summary[f"load_ratio_{tag}"] = peer_get / our_get
        exists_s, ping_s, per_node = lookup(cluster, 1024)
        local_s, shared_s, match_per_node = engine_match(cluster)
    print_table(f"remote tier on a 3-node Redis Cluster on loopback, {total // MiB} MiB a size "
                "(MiB/s; ratio = ours / redis-py peer)",
                ["entries", "n", "store", "peer", "ratio", "load", "peer", "ratio"], rows)
    print_table("a Match's remote lookup: exists() of 1,024 entries (half present)",
                ["what", "microseconds"],
                [("exists()", exists_s * 1e6), ("one PING per node, at once", ping_s * 1e6),
                 ("pipelines per node per exists()", per_node)])
    print_table("Match of a 1,024-page prompt whose first 512 pages are local, the rest remote",
                ["what", "microseconds"],
                [("local Match (no remote tier)", local_s * 1e6),
                 ("Match consulting the remote tier", shared_s * 1e6),
                 ("added by the remote tier", (shared_s - local_s) * 1e6),
                 ("one PING per node, at once", ping_s * 1e6),
                 ("pipelines per node per Match", match_per_node)])
    summary.update(lookup_us=exists_s * 1e6, ping_us=ping_s * 1e6, pipelines_per_node=per_node,
                   match_local_us=local_s * 1e6, match_remote_us=shared_s * 1e6,
                   match_pipelines_per_node=match_per_node)
    print_summary(**summary)


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)")
