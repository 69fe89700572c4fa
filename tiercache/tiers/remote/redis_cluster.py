"""The remote tier on Redis Cluster (or Valkey), through redis-py's `RedisCluster`.

redis-py discovers the cluster from any node given and keeps the slot map; this adapter
routes each entry's keys to their node itself and sends each node one pipeline per call,
all nodes at once on a small thread pool, so a lookup costs one round trip per node.
It does not use redis-py's cluster pipeline: that one retries a failed node's commands
one by one, with backoff, which would stall a Match for seconds while a node is down.
Here every failure is counted and becomes a miss or a skipped write at once: a node that
cannot be reached is left alone for `retry_seconds`, a MOVED reply refreshes the slot
map in the background, and whatever has not answered within the call's budget is a
miss. Reads check everything the metadata promises (entry.py).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from redis import exceptions as rx
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from tiercache.tiers.remote import entry as fmt
from tiercache.tiers.remote.entry import EntryRef, Meta
from tiercache.tiers.remote.incidents import Incidents
from tiercache.tiers.remote.resp import Command, batches, failure_of, pack
from tiercache.tiers.remote.store import (Damage, Entry, Failure, Fetched, Found, RemoteConfig,
                                          RemoteStats, Wanted, Written, nodes)

log = logging.getLogger("tiercache.remote")
_REFRESH_SECONDS = 1.0  # the slot map is read again at most this often


@dataclass(frozen=True)
class _Routed:
    """Commands about one entry: they share a hash tag, so a node and a pipeline."""

    route: bytes  # a key of the entry
    commands: list[Command]


class RedisClusterStore:
    def __init__(self, config: RemoteConfig, connect: Callable[[], RedisCluster]) -> None:
        self.config = config
        self._connect = connect
        self._cluster: RedisCluster | None = None
        self._lock = threading.Lock()  # guards _cluster and the refresh times
        self._next_connect = 0.0
        self._next_refresh = 0.0
        self._stats = RemoteStats()
        self._incidents = Incidents(config.retry_seconds)
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="tiercache-remote")
        self._closed = False

    @classmethod
    def open(cls, config: RemoteConfig) -> "RedisClusterStore":
        """A store for the cluster at `config.url`. A cluster that cannot be reached now
        is not an error: every call is a miss until one of its nodes answers."""
        timeout = max(config.get_seconds, config.put_seconds)

        def connect() -> RedisCluster:
            return RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in nodes(config.url)],
                require_full_coverage=False, retry=Retry(NoBackoff(), 0),
                socket_timeout=timeout, socket_connect_timeout=config.connect_seconds)
        store = cls(config, connect)
        store._cluster_now()
        return store

    # -- the contract -------------------------------------------------------------------
    def exists(self, refs: Sequence[EntryRef], seconds: float | None = None) -> Found:
        start = time.perf_counter()
        keys = fmt.meta_keys(self.config.prefix, self.config.namespace, list(refs))
        replies = self._run([_Routed(k, [("GET", k)]) for k in keys],
                            self.config.lookup_seconds if seconds is None else seconds)
        metas: list[Meta | None] = []
        for ref, key, reply in zip(refs, keys, replies):
            record = reply[0] if isinstance(reply, list) else None
            meta = fmt.parse(key, ref, record)
            if record is not None and meta is None:
                self._stats.add("damaged_meta")
            metas.append(meta)
        self._stats.add("lookups", len(refs))
        self._stats.add("lookup_hits", sum(m is not None for m in metas))
        self._stats.timed("exists", time.perf_counter() - start)
        return Found(tuple(metas))

    def get(self, wanted: Sequence[Wanted], targets: Sequence[memoryview],
            seconds: float | None = None) -> Fetched:
        start = time.perf_counter()
        deadline = start + (self.config.get_seconds if seconds is None else seconds)
        ok: list[bool] = []
        for lo, hi in batches([w.nbytes for w in wanted]):
            ok += self._get_batch(wanted[lo:hi], targets[lo:hi], deadline)
        nbytes = sum(w.nbytes for w, good in zip(wanted, ok) if good)
        self._stats.add("gets", len(wanted))
        self._stats.add("get_hits", sum(ok))
        self._stats.add("bytes_read", nbytes)
        self._stats.timed("get", time.perf_counter() - start)
        return Fetched(tuple(ok), nbytes)

    def put(self, entries: Sequence[Entry], seconds: float | None = None) -> Written:
        start = time.perf_counter()
        deadline = start + (self.config.put_seconds if seconds is None else seconds)
        total = Written(0, 0, 0, 0, ())
        for lo, hi in batches([e.payload.nbytes for e in entries]):
            total += self._put_batch(entries[lo:hi], deadline)
        self._stats.add("puts", len(entries))
        self._stats.add("put_stored", total.stored)
        self._stats.add("put_present", total.present)
        self._stats.add("put_skipped", total.skipped)
        self._stats.add("bytes_written", total.nbytes)
        self._stats.timed("put", time.perf_counter() - start)
        return total

    def delete(self, refs: Sequence[EntryRef], seconds: float | None = None) -> int:
        start = time.perf_counter()
        budget = self.config.put_seconds if seconds is None else seconds
        found = self.exists(refs, budget)
        routed = []
        for ref, meta in zip(refs, found.metas):
            if meta is not None:
                keys = self._keys(ref, meta.parts)
                routed.append(_Routed(keys.meta, [("DEL", keys.meta, *keys.parts)]))
        replies = self._run(routed, budget)
        gone = sum(isinstance(r, list) and bool(r[0]) for r in replies)
        self._stats.add("deletes", gone)
        self._stats.timed("delete", time.perf_counter() - start)
        return gone

    def stats(self) -> dict[str, int]:
        return self._stats.snapshot()

    def latency(self) -> dict[str, tuple[list[int], int, float]]:
        return self._stats.latency()

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            if self._cluster is not None:
                self._cluster.close()
                self._cluster = None

    # -- reads and writes -----------------------------------------------------------------
    def _keys(self, ref: EntryRef, parts: int) -> fmt.Keys:
        return fmt.entry_keys(self.config.prefix, self.config.namespace, ref, parts)

    def _get_batch(self, wanted: Sequence[Wanted], targets: Sequence[memoryview],
                   deadline: float) -> list[bool]:
        """Metadata and parts of each entry in one pipeline to its node, then checked."""
        part_bytes = self.config.part_bytes
        keys = [self._keys(w.ref, fmt.part_count(w.nbytes, part_bytes)) for w in wanted]
        routed = [_Routed(k.meta, [("GET", k.meta), *(("GET", p) for p in k.parts)])
                  for k in keys]
        replies = self._run(routed, deadline - time.perf_counter())
        ok, damaged = [], []
        for w, k, target, reply in zip(wanted, keys, targets, replies):
            if not isinstance(reply, list):
                ok.append(False)
                continue
            damage = _verify(w, k, target, reply) if reply[0] is not None else None
            ok.append(reply[0] is not None and damage is None)
            if damage is not None:
                self._stats.add(f"damaged_{damage.value}")
                if damage is not Damage.MISMATCH:  # another caller's entry, sound
                    damaged.append(k.meta)
        self._stats.add("get_misses", ok.count(False))
        if damaged:  # never served again: the next demotion of the entry writes it anew
            self._pool.submit(self._run, [_Routed(m, [("DEL", m)]) for m in damaged],
                              self.config.put_seconds)
        return ok

    def _put_batch(self, entries: Sequence[Entry], deadline: float) -> Written:
        part_bytes = self.config.part_bytes
        metas = [fmt.new_meta(e.ref, e.depth, e.check, e.payload, part_bytes) for e in entries]
        keys = [self._keys(e.ref, m.parts) for e, m in zip(entries, metas)]
        there = self._run([_Routed(k.meta, [("EXISTS", k.meta)]) for k in keys],
                          deadline - time.perf_counter())
        todo = [i for i, r in enumerate(there) if isinstance(r, list) and r[0] == 0]
        landed = [isinstance(r, list) and r[0] == 1 for r in there]
        parts = self._run([_Routed(keys[i].meta, [
            ("SET", part, entries[i].payload[a:b])
            for part, (a, b) in zip(keys[i].parts, fmt.part_spans(metas[i].nbytes, part_bytes))])
            for i in todo], deadline - time.perf_counter())
        whole = [i for i, r in zip(todo, parts) if isinstance(r, list) and all(x == b"OK" for x in r)]
        sealed = self._run([_Routed(keys[i].meta, [("SET", keys[i].meta, fmt.seal(keys[i].meta, metas[i]))])
                            for i in whole], deadline - time.perf_counter())
        stored = [i for i, r in zip(whole, sealed) if isinstance(r, list) and r[0] == b"OK"]
        nbytes = sum(entries[i].payload.nbytes for i in stored)
        present = sum(landed)
        for i in stored:
            landed[i] = True
        return Written(len(stored), present, len(entries) - present - len(stored), nbytes,
                       tuple(landed))

    # -- routing and pipelines ------------------------------------------------------------
    def _run(self, routed: Sequence[_Routed], seconds: float) -> list[list[Any] | Failure]:
        """Each entry's replies (a list, errors in place), or the Failure that kept it
        from an answer: one pipeline per node, all nodes at once, within `seconds`."""
        results: list[list[Any] | Failure] = [Failure.CONNECTION] * len(routed)
        cluster = self._cluster_now()
        if cluster is None or not routed or self._closed:
            return results
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i, item in enumerate(routed):
            try:
                node = cluster.get_node_from_key(item.route)
            except rx.RedisError as error:  # a slot no node serves
                results[i] = failure_of(error)
                continue
            by_node.setdefault(node.name, (node, []))[1].append(i)
        futures = {}
        for name, (node, members) in by_node.items():
            if self._incidents.skip(name):
                self._stats.add("errors_node_down")
                for i in members:
                    results[i] = Failure.NODE_DOWN
                continue
            commands = [c for i in members for c in routed[i].commands]
            futures[self._pool.submit(self._pipeline, node, commands)] = (name, members)
        done, late = wait(futures, timeout=max(seconds, 0.0))
        for future, (name, members) in futures.items():
            replies = future.result() if future in done else Failure.TIMEOUT
            self._settle(name, replies, members, routed, results)
        return results

    def _settle(self, node: str, replies: list[Any] | Failure, members: list[int],
                routed: Sequence[_Routed], results: list[list[Any] | Failure]) -> None:
        """Hand a node's replies to its entries; count and log what failed."""
        if isinstance(replies, Failure):
            self._failed(node, replies, "no answer within the budget"
                         if replies is Failure.TIMEOUT else "the pipeline failed")
            for i in members:
                results[i] = replies
            return
        failures: dict[Failure, BaseException] = {}
        at = 0
        for i in members:
            mine = replies[at:at + len(routed[i].commands)]
            at += len(mine)
            errors = [r for r in mine if isinstance(r, BaseException)]
            results[i] = mine if not errors else failure_of(errors[0])
            for error in errors:
                failures.setdefault(failure_of(error), error)
        for failure, error in failures.items():
            self._failed(node, failure, str(error)[:200])
        if not failures:
            self._incidents.answered(node)

    def _failed(self, node: str, failure: Failure, detail: str) -> None:
        self._stats.add(f"errors_{failure.value}")
        self._incidents.failed(node, failure, detail)
        if failure in (Failure.MOVED, Failure.CONNECTION, Failure.CLUSTER_DOWN):
            self._refresh_soon()

    def _pipeline(self, node: ClusterNode, commands: list[Command]) -> list[Any] | Failure:
        """Send `commands` to `node` in one write and read their replies (an error reply
        in place of its command's result). Packed here, not by redis-py's pipeline,
        which spends ~20 us of Python per command: a lookup sends thousands."""
        pool = node.redis_connection.connection_pool
        try:
            connection = pool.get_connection()
        except Exception as error:  # noqa: BLE001 - any failure is a miss, counted
            return failure_of(error)
        try:
            connection.send_packed_command(pack(commands), check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(connection.read_response())
                except rx.ResponseError as error:  # MOVED, ASK, OOM...: that command's
                    replies.append(error)
            return replies
        except Exception as error:  # noqa: BLE001 - replies may be left unread: drop it
            connection.disconnect()
            failure = failure_of(error)
            if failure is Failure.OTHER:
                log.debug("remote tier: a pipeline to %s failed", node.name, exc_info=True)
            return failure
        finally:
            pool.release(connection)

    def _cluster_now(self) -> RedisCluster | None:
        """The cluster client, connecting (at most every retry_seconds) if there is none."""
        with self._lock:
            if self._cluster is not None or self._closed:
                return self._cluster
            now = time.monotonic()
            if now < self._next_connect:
                return None
            self._next_connect = now + self.config.retry_seconds
            try:
                self._cluster = self._connect()
            except Exception as error:  # noqa: BLE001 - unreachable now: misses until it is not
                self._stats.add("errors_connection")
                self._incidents.failed("cluster", Failure.CONNECTION, str(error)[:200])
                return None
        self._incidents.answered("cluster")
        return self._cluster

    def _refresh_soon(self) -> None:
        """Read the slot map again, in the background, at most every second."""
        with self._lock:
            now = time.monotonic()
            if self._cluster is None or now < self._next_refresh or self._closed:
                return
            self._next_refresh = now + _REFRESH_SECONDS
            cluster = self._cluster
        try:
            self._pool.submit(_refresh, cluster)
        except RuntimeError:  # the pool is shutting down
            pass


def _refresh(cluster: RedisCluster) -> None:
    try:
        cluster.nodes_manager.initialize()
    except Exception:  # noqa: BLE001 - no node answers: the old map stays
        log.debug("remote tier: reading the slot map failed", exc_info=True)


def _verify(wanted: Wanted, keys: fmt.Keys, target: memoryview, reply: list[Any]) -> Damage | None:
    """Check an entry's parts against its metadata, then copy them into `target`."""
    meta = fmt.parse(keys.meta, wanted.ref, reply[0])
    if meta is None:
        return Damage.META
    if meta.nbytes != wanted.nbytes or meta.parts != len(keys.parts) or (
            wanted.check and meta.check and wanted.check != meta.check):
        return Damage.MISMATCH
    parts, spans = reply[1:], fmt.part_spans(meta.nbytes, meta.part_bytes)
    if any(part is None for part in parts):
        return Damage.PART_MISSING
    if any(len(part) != b - a for part, (a, b) in zip(parts, spans)):
        return Damage.PART_SIZE
    if fmt.checksum(wanted.ref, meta.depth, meta.check, parts) != meta.checksum:
        return Damage.CHECKSUM
    out = np.frombuffer(target, np.uint8)
    for part, (a, b) in zip(parts, spans):
        out[a:b] = np.frombuffer(part, np.uint8)
    return None
