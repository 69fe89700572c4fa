"""Past one node with real processes: two daemons (two data directories, one shared
secret) on one real Redis Cluster. A prompt stored through daemon A by one worker
process is matched as remote and loaded byte for byte through daemon B by another; A's
KV event stream tells a router about the store, first in A's host tier, then under the
remote tier's shared pseudo pod."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import msgpack
import zmq

from tests.polling import eventually
from tests.redis_cluster import needs_redis, redis_cluster
from tests.service.daemon import ROOT, running_daemon
from tests.service.worker_process import LAYOUT, PAGES, prompt
from tiercache_service.stats_cli import render
from tiercache.client import Client
from tiercache.results import Tier

pytestmark = needs_redis
PROMPTS = 3


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tests.service.worker_process", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_prompt_stored_through_daemon_a_is_loaded_byte_for_byte_through_daemon_b(tmp_path):
    events = f"tcp://127.0.0.1:{free_port()}"
    secret = str(tmp_path / "shared-secret")  # both daemons mask keys alike
    with redis_cluster(tmp_path / "redis") as cluster:
        common = ("--remote", cluster.url, "--secret-file", secret)
        with running_daemon(tmp_path / "a", *common, "--kv-events", events,
                            "--kv-events-pod", "node-a:5557") as (a, _), \
                running_daemon(tmp_path / "b", *common) as (b, _):
            sub = zmq.Context.instance().socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
            sub.connect(events)
            time.sleep(0.3)  # a SUB socket misses what is sent before it has joined
            # a worker process stores 3 prompts (6 pages and a checkpoint each) through A
            assert worker("store", a, "21", str(PROMPTS)).split() == \
                ["stored", "0", "stored", "1", "stored", "2"]
            entries = PROMPTS * (PAGES + 1)
            assert eventually(lambda: Client(a).stats().counters["remote_written"] == entries,
                              30.0), "timed out waiting for daemon A to write the store to the cluster"
            # B has never seen the prompts: a match finds them in the remote tier
            probe = Client(b).register("test-model", LAYOUT)
            match = probe.match(prompt(0))
            assert match.pages == PAGES and match.page_tiers == (Tier.REMOTE,) * PAGES
            assert match.checkpoint_tier is Tier.REMOTE
            probe.close()
            # another worker process loads them through B, into other rows: byte for byte
            assert worker("load", b, "21", str(PROMPTS)).split() == ["ok", "0", "ok", "1", "ok", "2"]
            stats = Client(b).stats()
            counters = stats.counters
            assert counters["remote_fetched"] == entries and counters["remote_get_hits"] == entries
            assert f"fetched {entries}" in render(b, stats)  # tiercache stats shows the tier
            topics = _topics(sub, want={"kv@node-a:5557@test-model", "kv@tiercache-remote@test-model"})
            sub.close(linger=0)
    # A published its host stores and its remote writes, under the remote pseudo pod
    assert {e["medium"] for e in topics["kv@node-a:5557@test-model"]} >= {"CPU"}
    remote = topics["kv@tiercache-remote@test-model"]
    assert sum(len(e["block_hashes"]) for e in remote if e["type"] == "BlockStored") == entries


def _topics(sub: zmq.Socket, want: set[str]) -> dict[str, list[dict]]:
    """Events received per topic: until every topic in `want` has had some and nothing
    more comes for half a second."""
    seen: dict[str, list[dict]] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not sub.poll(500):
            if want <= set(seen):
                break
            continue
        topic, _, payload = sub.recv_multipart()
        seen.setdefault(topic.decode(), []).extend(msgpack.unpackb(payload)[1])
    return seen
