"""The daemon's Prometheus metrics. Every name, type, help text and label is declared
once, in METRICS; the dashboard and the tests check against it.

The engine's numbers are read when Prometheus scrapes (`EngineCollector`), never copied
into a second set of counters; only what the engine cannot see, calls and their
latency, is counted here (`CallMetrics`, fed by service.observe), and lookups by call
and model (service.lookups, fed by the servicer). Labels name RPC methods, status codes,
tiers, reasons, and model ids (the first 32; later ones are "other"): never a tenant, a
key or a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    Metric as Family)
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from tiercache import __version__
from tiercache_service.lookups import Lookups
from tiercache.engine import Engine
from tiercache.results import Tier
from tiercache.store import NO_SCOPE
from tiercache.metrics import BUCKETS, HopStats
from tiercache.tiers.remote.store import Damage, Failure

PREFIX = "tiercache_"
TIERS = tuple(t.name.lower() for t in Tier)
LOCAL_TIERS = tuple(t.name.lower() for t in Tier if t != Tier.REMOTE)  # those that evict
# Seconds: a Match over a Unix socket takes ~100 us, a large Store or a disk-bound Load
# seconds.
CALL_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class Metric:
    name: str  # after PREFIX; counters without _total (the exposition adds it)
    kind: str  # counter, gauge or histogram
    help: str
    labels: tuple[str, ...] = ()

    @property
    def full_name(self) -> str:
        return PREFIX + self.name

    @property
    def exposed(self) -> str:
        """The name a scrape shows (counters end in _total)."""
        return self.full_name + ("_total" if self.kind == "counter" else "")


METRICS = {m.name: m for m in (
    Metric("rpc_requests", "counter", "gRPC calls finished, by service, method and status code "
           "(a Match, Load or Store sent on a worker's Calls stream counts under its own method).",
           ("service", "method", "code")),
    Metric("stream_disconnects", "counter", "Streams whose client went away (a worker leaving "
           "its Register stream, a health Watch ending): normal ends, not failed calls, and not "
           "in rpc_requests.", ("service", "method")),
    Metric("rpc_duration_seconds", "histogram", "Time to answer a unary gRPC call (Match, Load, "
           "Store, ...) or a message of a Calls stream, from its arrival to its answer.",
           ("service", "method")),
    Metric("matches", "counter", "Match calls answered."),
    Metric("match_requested_pages", "counter", "Full pages in the prompts given to Match."),
    Metric("matched_pages", "counter", "Pages Match found, by the best tier that held each.",
           ("tier",)),
    Metric("matched_tokens", "counter", "Tokens Match found, by the tier of their page (or of the "
           "checkpoint, for layouts without KV pages).", ("tier",)),
    Metric("matched_checkpoints", "counter", "Checkpoints at the end of a Match hit, by the tier "
           "that held each.", ("tier",)),
    Metric("lookups", "counter", "Calls that looked up a prompt, by call and model id: match "
           "(Match), load (a Load no Match of its prompt came before, e.g. the transformers "
           "adapter), load_after_match (a Load of what a Match just found: its pages were asked "
           "under that Match). Models past the first 32 count as model=\"other\".",
           ("call", "model")),
    Metric("lookup_pages", "counter", "Full pages asked by lookups, by call and model id: a "
           "Match's prompt, or the pages a Load could take (its kv rows; the prompt without "
           "paged buffers).", ("call", "model")),
    Metric("lookup_hit_pages", "counter", "Pages lookups found (Match) or copied into the worker "
           "(Load), by call and model id.", ("call", "model")),
    Metric("hit_ratio", "gauge", "Hit pages over asked pages of call=match and call=load "
           "lookups together (each prompt counted once: load_after_match is left out), by "
           "model id, since the daemon started.", ("model",)),
    Metric("loads", "counter", "Loads that copied a hit into a worker."),
    Metric("loaded_pages", "counter", "Pages copied into workers by loads."),
    Metric("transfer_bytes", "counter", "Bytes copied between workers and tiers, by hop "
           "(a load from disk counts disk->host and host->worker).", ("source", "destination")),
    Metric("transfer_seconds", "histogram", "Duration of one batched copy, by hop (asynchronous "
           "GPU loads are not timed).", ("source", "destination")),
    Metric("tier_used_bytes", "gauge", "Bytes of entries held in the tier.", ("tier",)),
    Metric("tier_capacity_bytes", "gauge", "The tier's byte budget.", ("tier",)),
    Metric("tier_entries", "gauge", "Entries (KV pages and checkpoints) in the tier.", ("tier",)),
    Metric("evictions", "counter", "Entries removed from a tier, by reason: capacity (the "
           "eviction policy made room), request (Evict calls), damaged (failed checksum).",
           ("tier", "reason")),
    Metric("admissions", "counter", "Entries offered by stores, by kind and outcome: stored, "
           "declined (by the checkpoint admission policy) or no_room (host full of pinned "
           "entries). Entries cached already are not counted.", ("kind", "outcome")),
    Metric("demotions", "counter", "Host entries written to disk by their own eviction (the "
           "background writer had not reached them)."),
    Metric("disk_writes", "counter", "Host entries the background writer copied to disk."),
    Metric("copies_down", "counter", "Device entries copied down to the host tier (behind "
           "their store, or when evicted from the device)."),
    Metric("promotions", "counter", "Disk entries copied up into the host tier."),
    Metric("prefetches", "counter", "Disk entries a Match asked to promote ahead of its Load."),
    Metric("promotion_waits", "counter", "Loads that waited for a promotion in flight."),
    Metric("unpublished_stores", "counter", "Stores that replied once their copies were "
           "queued, whose entries could not be published after (a copy failed): their "
           "entries are misses."),
    Metric("eviction_regrets", "counter", "Evicted entries that were stored again soon after "
           "(they tune FLOP-aware eviction)."),
    Metric("checksum_failures", "counter", "Disk entries whose checksum failed when read: dropped, "
           "never served."),
    Metric("collisions", "counter", "Keys found whose entry another prompt stored (its check "
           "differs): misses, never served."),
    Metric("foreign_entries", "counter", "Keys found whose entry has another size than the "
           "caller's layout: misses, never read."),
    Metric("disk_write_errors", "counter", "Disk writes the file system refused (no space, I/O "
           "errors): the entries stay in memory; the tier retries after a pause."),
    Metric("disk_moved_aside", "gauge", "1 if the LMDB environment was damaged at start and "
           "moved aside (the disk tier started empty), else 0."),
    Metric("eviction_alpha", "gauge", "Weight of recency against saved FLOPs in FLOP-aware "
           "eviction (absent under LRU)."),
    Metric("remote_lookups", "counter", "Entries a Match asked the remote tier about, beyond its "
           "local hit, by outcome: hit (sound metadata) or miss.", ("outcome",)),
    Metric("remote_fetches", "counter", "Entries a Load fetched from the remote tier into host "
           "slots, by outcome: hit (whole and verified) or miss.", ("outcome",)),
    Metric("remote_writes", "counter", "Entries written behind stores to the remote tier, by "
           "outcome: stored, present (there already) or skipped (a failure, the budget, a full "
           "queue, or evicted before the writer reached it).", ("outcome",)),
    Metric("remote_errors", "counter", "Failed remote-tier node calls, by kind: connection, "
           "node_down (skipped while it is down), timeout, moved, ask, oom, cluster_down, "
           "other. Each is a miss or a skipped write, never a failed call.", ("kind",)),
    Metric("remote_damaged", "counter", "Remote entries found but not served, by reason: meta, "
           "mismatch, part_missing, part_size, checksum.", ("reason",)),
    Metric("remote_seconds", "histogram", "Duration of one remote-tier call (all its node "
           "pipelines), by operation: exists, get, put, delete.", ("operation",)),
    Metric("kv_event_batches", "counter", "KV event batches published to routers."),
    Metric("kv_events_dropped", "counter", "Tier changes dropped before publishing (the queue "
           "was full): routers were told to start over (AllBlocksCleared)."),
    Metric("rebuild_seconds", "gauge", "Seconds the startup rebuild of the index from the disk "
           "tier took (0 without a disk tier)."),
    Metric("rebuild_entries", "gauge", "Entries the startup rebuild indexed from the disk tier."),
    Metric("flush_seconds", "counter", "Seconds spent flushing the host tier to disk (at "
           "shutdown; metrics answer until the flush ends)."),
    Metric("flush_entries", "counter", "Host entries written to disk while flushes ran."),
    Metric("registered_workers", "gauge", "Workers registered now."),
    Metric("ipc_allocations", "gauge", "CUDA allocations of workers that the daemon holds open."),
    Metric("build_info", "gauge", "Always 1; its label is the daemon's version (tiercache "
           "--version).", ("version",)),
)}

# Plain engine counters (and the disk_moved_aside flag), one metric each.
_PLAIN = {"matches": "matches", "match_requested_pages": "requested_pages", "loads": "loads",
          "loaded_pages": "loaded_pages", "demotions": "demoted", "disk_writes": "disk_writes",
          "copies_down": "copied_down",
          "promotions": "promoted", "prefetches": "prefetches",
          "promotion_waits": "promotion_waits", "eviction_regrets": "regrets",
          "unpublished_stores": "unpublished_stores",
          "checksum_failures": "checksum_failures", "collisions": "collisions",
          "foreign_entries": "foreign_entries", "disk_write_errors": "disk_write_errors",
          "disk_moved_aside": "disk_moved_aside", "kv_event_batches": "kv_event_batches",
          "kv_events_dropped": "kv_events_dropped"}
# Counters shown as the sum of a labelled metric's series (matched_pages{tier}).
_SUMMED = {"matched_pages": "matched_pages"}
# Labelled engine counters: metric -> {label values: counter}.
_LABELLED = {
    "matched_pages": {(t,): f"matched_pages_{t}" for t in TIERS},
    "matched_tokens": {(t,): f"matched_tokens_{t}" for t in TIERS},
    "matched_checkpoints": {(t,): f"matched_checkpoints_{t}" for t in TIERS},
    "evictions": {**{(t, "capacity"): f"evicted_{t}" for t in LOCAL_TIERS},
                  **{(t, "request"): f"evicted_{t}_by_request" for t in LOCAL_TIERS},
                  **{(t, "damaged"): f"evicted_{t}_damaged" for t in LOCAL_TIERS}},
    "remote_lookups": {("hit",): "remote_lookup_hits", ("miss",): "remote_lookup_misses"},
    "remote_fetches": {("hit",): "remote_get_hits", ("miss",): "remote_get_misses"},
    "remote_writes": {("stored",): "remote_put_stored", ("present",): "remote_put_present",
                      ("skipped",): "remote_writes_skipped"},
    "remote_errors": {(f.value,): f"remote_errors_{f.value}" for f in Failure},
    "remote_damaged": {(d.value,): f"remote_damaged_{d.value}" for d in Damage},
    "admissions": {("page", "stored"): "stored_pages", ("page", "no_room"): "skipped_pages",
                   ("checkpoint", "stored"): "stored_checkpoints",
                   ("checkpoint", "declined"): "declined_checkpoints",
                   ("checkpoint", "no_room"): "skipped_checkpoints"},
}


def _family(name: str) -> Family:
    metric = METRICS[name]
    families = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
                "histogram": HistogramMetricFamily}
    return families[metric.kind](metric.full_name, metric.help, labels=list(metric.labels))


def _histogram(family: HistogramMetricFamily, labels: list[str], hop: HopStats) -> None:
    cumulative, buckets = 0, []
    for bound, count in zip((*BUCKETS, float("inf")), hop.counts):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    family.add_metric(labels, buckets, hop.seconds)


class EngineCollector:
    """Reads the engine's stats and the worker registry at each scrape."""

    def __init__(self, engine: Engine, workers: Callable[[], int],
                 ipc_allocations: Callable[[], int], lookups: Lookups) -> None:
        self.engine = engine
        self.workers = workers
        self.ipc_allocations = ipc_allocations
        self.lookups = lookups

    def collect(self) -> Iterator[Family]:
        stats = self.engine.stats(scope=NO_SCOPE)  # a scrape waits for nobody's stores
        counters = stats.counters
        for name, key in _PLAIN.items():
            yield self._value(name, counters.get(key, 0))
        for name, keys in _LABELLED.items():
            family = _family(name)
            for labels, key in keys.items():  # device series read zero until a device tier
                family.add_metric(list(labels), counters.get(key, 0))
            yield family
        yield from self.lookups.families(*(_family(n) for n in ("lookups", "lookup_pages",
                                                                  "lookup_hit_pages", "hit_ratio")))
        yield from self._chores()
        yield from self._tiers(stats.tiers)
        yield from self._traffic()
        yield self._remote_latency()
        if stats.alpha is not None:
            yield self._value("eviction_alpha", stats.alpha)
        yield self._value("registered_workers", self.workers())
        yield self._value("ipc_allocations", self.ipc_allocations())
        build = _family("build_info")
        build.add_metric([__version__], 1)
        yield build

    @staticmethod
    def _value(name: str, value: float) -> Family:
        family = _family(name)
        family.add_metric([], value)
        return family

    def _chores(self) -> Iterator[Family]:
        rebuilt, flushed = self.engine.rebuilt, self.engine.flushed
        yield self._value("rebuild_seconds", rebuilt.seconds)
        yield self._value("rebuild_entries", rebuilt.entries)
        yield self._value("flush_seconds", flushed.seconds)
        yield self._value("flush_entries", flushed.entries)

    @staticmethod
    def _tiers(tiers) -> Iterator[Family]:
        used, capacity, entries = (_family(n) for n in ("tier_used_bytes", "tier_capacity_bytes",
                                                        "tier_entries"))
        for tier in tiers:
            name = [tier.tier.name.lower()]
            used.add_metric(name, tier.used_bytes)
            capacity.add_metric(name, tier.budget_bytes)
            entries.add_metric(name, tier.entries)
        yield from (used, capacity, entries)

    def _remote_latency(self) -> Family:
        family = _family("remote_seconds")
        remote = self.engine.remote
        for operation, (counts, _, seconds) in (remote.store.latency() if remote else {}).items():
            _histogram(family, [operation], HopStats(0, sum(counts), seconds, counts))
        return family

    def _traffic(self) -> Iterator[Family]:
        moved, seconds = _family("transfer_bytes"), _family("transfer_seconds")
        for (source, destination), hop in self.engine.traffic.snapshot().items():
            moved.add_metric([source, destination], hop.bytes)
            _histogram(seconds, [source, destination], hop)
        yield from (moved, seconds)


class CallMetrics:
    """Calls by method and status, and unary call latency; one set per daemon, in the
    daemon's own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        calls, latency = METRICS["rpc_requests"], METRICS["rpc_duration_seconds"]
        left = METRICS["stream_disconnects"]
        self.calls = Counter(calls.full_name, calls.help, calls.labels, registry=registry)
        self.disconnects = Counter(left.full_name, left.help, left.labels, registry=registry)
        self.latency = Histogram(latency.full_name, latency.help, latency.labels,
                                 registry=registry, buckets=CALL_BUCKETS)

        self._children: dict[tuple, Any] = {}  # labels() takes a lock: look each up once

    def observe(self, service: str, method: str, code: str, seconds: float, unary: bool) -> None:
        calls = self._children.get((service, method, code))
        if calls is None:
            calls = self._children[(service, method, code)] = self.calls.labels(service, method, code)
        calls.inc()
        if unary:  # a stream (Register, health Watch) lasts as long as its client: no latency
            latency = self._children.get((service, method))
            if latency is None:
                latency = self._children[(service, method)] = self.latency.labels(service, method)
            latency.observe(seconds)

    def disconnected(self, service: str, method: str) -> None:
        """A stream whose client went away: a normal end, counted apart from calls."""
        self.disconnects.labels(service, method).inc()


def registry_for(engine: Engine, workers: Callable[[], int], ipc_allocations: Callable[[], int],
                 lookups: Lookups) -> tuple[CollectorRegistry, CallMetrics]:
    """A registry with the engine's metrics, the lookups and calls the servicer counts, and
    the process's own (CPU, memory, open files)."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, workers, ipc_allocations, lookups))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry, CallMetrics(registry)
