"""The /metrics endpoint of a real daemon: every series moves by exactly what a scripted
store, match and load should move it by, the output passes promtool, and no label
carries anything a client chose."""

from __future__ import annotations

import subprocess
import time

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tiercache_service.lookups import CALLS, OTHER_MODEL
from tiercache_service.metrics import METRICS, PREFIX, TIERS
from tests.service.daemon import metrics_url, needs_promtool, running_daemon, scrape
from tests.service.worker_process import LAYOUT, prompt
from tiercache import __version__
from tiercache.client import Client
from tiercache.metrics import PLACES
from tiercache.tiers.remote.store import OPERATIONS, Damage, Failure
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

PAGE, STATE = LAYOUT.page_bytes, LAYOUT.checkpoint_bytes
TIERCACHE = "tiercache.v1.Tiercache"


def series(text: str) -> dict[tuple, float]:
    """tiercache_* samples by (name, sorted labels); histogram sums and finite buckets
    are left out: they depend on how long each copy took."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(PREFIX) or sample.name.endswith(("_sum", "_created")):
                continue
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                continue
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def changes(before: dict, after: dict) -> dict[tuple, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def s(name: str, **labels: str) -> tuple:
    return (name, tuple(sorted(labels.items())))


def rpc(method: str, code: str = "OK") -> dict[tuple, float]:
    """What one finished unary call adds."""
    return {s("tiercache_rpc_requests_total", service=TIERCACHE, method=method, code=code): 1,
            s("tiercache_rpc_duration_seconds_count", service=TIERCACHE, method=method): 1,
            s("tiercache_rpc_duration_seconds_bucket", service=TIERCACHE, method=method, le="+Inf"): 1}


def hop(source: str, destination: str, nbytes: int, copies: int) -> dict[tuple, float]:
    return {s("tiercache_transfer_bytes_total", source=source, destination=destination): nbytes,
            s("tiercache_transfer_seconds_count", source=source, destination=destination): copies,
            s("tiercache_transfer_seconds_bucket", source=source, destination=destination,
              le="+Inf"): copies}


def lookup(call: str, model: str, asked: int, hit: int) -> dict[tuple, float]:
    """What one lookup of `asked` pages that hit `hit` adds."""
    return {s("tiercache_lookups_total", call=call, model=model): 1,
            s("tiercache_lookup_pages_total", call=call, model=model): asked,
            s("tiercache_lookup_hit_pages_total", call=call, model=model): hit}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("daemon")) as (address, process):
        yield address, metrics_url(process)


def test_a_scripted_store_match_and_load_move_exactly_their_series(daemon):
    address, url = daemon
    worker = Client(address).register("test-model", LAYOUT)
    whole = 6 * PAGE + STATE  # a prompt: 6 pages and the checkpoint at their end
    # 0. a registered worker shows; nothing was cached yet
    start = series(scrape(url))
    assert start[s("tiercache_registered_workers")] == 1
    assert start[s("tiercache_tier_entries", tier="host")] == 0
    # 1. store: 7 entries into the host, in two batches (pages, then the checkpoint)
    worker.store(prompt(0), kv_rows=range(6), checkpoints={96: 0})
    stored = series(scrape(url))
    assert changes(start, stored) == {
        **rpc("Store"), **hop("worker", "host", whole, 2),
        s("tiercache_admissions_total", kind="page", outcome="stored"): 6,
        s("tiercache_admissions_total", kind="checkpoint", outcome="stored"): 1,
        s("tiercache_tier_entries", tier="host"): 7,
        s("tiercache_tier_used_bytes", tier="host"): whole}
    # 2. match the prompt: 6 of its 6 full pages (96 tokens) and the checkpoint, all in host
    assert worker.match(prompt(0)).pages == 6
    matched = series(scrape(url))
    assert changes(stored, matched) == {
        **rpc("Match"), s("tiercache_matches_total"): 1,
        s("tiercache_match_requested_pages_total"): 6,
        s("tiercache_matched_pages_total", tier="host"): 6,
        s("tiercache_matched_tokens_total", tier="host"): 96,
        s("tiercache_matched_checkpoints_total", tier="host"): 1,
        **lookup("match", "test-model", 6, 6), s("tiercache_hit_ratio", model="test-model"): 1.0}
    # 3. load what the match found into other rows: the same bytes go host -> worker, in
    # one timed copy; a load after its match, so its pages are not asked a second time
    worker.load(prompt(0), kv_rows=range(10, 16), slot=3)
    loaded = series(scrape(url))
    assert changes(matched, loaded) == {
        **rpc("Load"), **hop("host", "worker", whole, 1),
        s("tiercache_loads_total"): 1, s("tiercache_loaded_pages_total"): 6,
        **lookup("load_after_match", "test-model", 6, 6)}
    # 4. a load for a worker that never registered: counted under its status, nothing else
    stub = pb_grpc.TiercacheStub(grpc.insecure_channel(address))
    with pytest.raises(grpc.RpcError) as failed:
        stub.Load(pb.LoadRequest(worker_id="nobody", keys=b"\0" * 16, kv_rows=[0]))
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    assert changes(loaded, series(scrape(url))) == rpc("Load", "NOT_FOUND")
    worker.close()


def test_a_load_without_a_match_counts_in_the_hit_rate(daemon):
    address, url = daemon
    worker = Client(address).register("loads-only", LAYOUT)
    worker.store(prompt(4), kv_rows=range(6), checkpoints={96: 0})
    before = series(scrape(url))
    # 1. loaded straight away, as the transformers adapter and the demo do: 6 pages asked
    # (rows for 8, but the prompt has 6 full pages), all 6 copied
    assert worker.load(prompt(4), kv_rows=range(10, 18), slot=3).match.pages == 6
    # 2. a prompt nobody stored, loaded: 6 pages asked, none found
    assert worker.load(prompt(5), kv_rows=range(10, 18), slot=3).match.pages == 0
    after = series(scrape(url))
    moved = changes(before, after)
    assert {k: v for k, v in moved.items() if "lookup" in k[0] or "hit_ratio" in k[0]} == {
        s("tiercache_lookups_total", call="load", model="loads-only"): 2,
        s("tiercache_lookup_pages_total", call="load", model="loads-only"): 12,
        s("tiercache_lookup_hit_pages_total", call="load", model="loads-only"): 6,
        s("tiercache_hit_ratio", model="loads-only"): 0.5}
    # 3. Match's own figures did not move: no Match was called
    assert s("tiercache_match_requested_pages_total") not in moved
    worker.close()


def test_a_worker_that_goes_away_is_a_disconnect_not_a_failed_call(tmp_path):
    # a daemon of its own: the module's may still see an earlier test's streams end (CI
    # once counted two Register disconnects here)
    with running_daemon(tmp_path) as (address, process):
        url = metrics_url(process)
        before = series(scrape(url))
        # 1. a worker registers, then goes away: its Register stream ends from its side
        # (no lane: its OpenLane call would be counted beside)
        Client(address, lanes=False).register("test-model", LAYOUT).close()
        left = s("tiercache_stream_disconnects_total", service=TIERCACHE, method="Register")
        deadline = time.monotonic() + 30  # the daemon sees the stream end within a second or so
        while left not in changes(before, series(scrape(url))) and time.monotonic() < deadline:
            time.sleep(0.05)
        # 2. counted as a disconnect, and as no call at all: no Register CANCELLED
        assert changes(before, series(scrape(url))) == {left: 1}


def test_labels_carry_only_names_the_daemon_chose(daemon):
    address, url = daemon
    # a tenant-looking model id, extra keys and a request id that a client chose
    worker = Client(address).register("tenant-acme/secret-model", LAYOUT, extra_keys=("lora-42",))
    worker.store(prompt(1), kv_rows=range(6), checkpoints={96: 0})
    worker.match(prompt(1))  # its model id becomes a label
    worker.close()
    allowed = {"tier": set(TIERS), "source": set(PLACES), "destination": set(PLACES),
               "service": {TIERCACHE, "grpc.health.v1.Health",
                           "grpc.reflection.v1alpha.ServerReflection"},
               "method": set(pb.DESCRIPTOR.services_by_name["Tiercache"].methods_by_name)
               | {"Check", "Watch", "ServerReflectionInfo"},
               "code": {c.name for c in grpc.StatusCode},
               "reason": {"capacity", "request", "damaged"} | {d.value for d in Damage},
               "kind": {"page", "checkpoint"} | {f.value for f in Failure},
               "outcome": {"stored", "declined", "no_room", "hit", "miss", "present", "skipped"},
               "operation": set(OPERATIONS), "version": {__version__}}
    declared = {m.full_name: m for m in METRICS.values()}
    text = scrape(url)
    # model ids are the one thing a client names that becomes a label (bounded: service.lookups)
    assert "lora-42" not in text and 'model="tenant-acme/secret-model"' in text
    allowed["model"] = {"test-model", "loads-only", "tenant-acme/secret-model", OTHER_MODEL}
    allowed["call"] = set(CALLS)
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIX):
            continue
        assert family.name in declared, f"{family.name} is not declared in service.metrics.METRICS"
        for sample in family.samples:
            names = set(sample.labels) - {"le"}
            assert names <= set(declared[family.name].labels), sample
            for name in names:
                assert sample.labels[name] in allowed[name], sample


@needs_promtool
def test_promtool_accepts_the_endpoint(daemon):
    address, url = daemon
    worker = Client(address).register("test-model", LAYOUT)  # so histograms have samples
    worker.store(prompt(2), kv_rows=range(6), checkpoints={96: 0})
    worker.load(prompt(2), kv_rows=range(10, 16), slot=3)
    worker.close()
    checked = subprocess.run(["promtool", "check", "metrics"], input=scrape(url), text=True,
                             capture_output=True, timeout=60)
    assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), (
        checked.stdout + checked.stderr)
