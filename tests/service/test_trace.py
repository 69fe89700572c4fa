"""The per-step breakdown (tiercache/trace.py) of a real daemon: one line per traced call,
its steps named, their times adding up to no more than the call's, each call placed on
the host's clock that the worker shares."""

from __future__ import annotations

import json
import time

from drills import prompts
from tests.service.daemon import running_daemon
from tiercache.client import Client


def test_a_daemon_asked_to_trace_writes_each_store_and_load_step_by_step(tmp_path, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("TIERCACHE_TRACE", str(trace))
    with running_daemon(tmp_path / "data", "--no-disk") as (address, _):
        before = time.perf_counter() * 1e3
        worker = Client(address).register(prompts.MODEL, prompts.LAYOUT)
        tokens = prompts.tokens(0)
        worker.store(tokens, kv_rows=range(prompts.PAGES), checkpoints={prompts.PAGES * prompts.PAGE: 0})
        assert worker.load(tokens, kv_rows=range(prompts.PAGES, 2 * prompts.PAGES), slot=1).match.pages
        after = time.perf_counter() * 1e3
        worker.close()
    calls = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [c["call"] for c in calls] == ["Store", "Load"]
    store, load = (c["ms"] for c in calls)
    assert {"request", "prepare", "claim", "reserve", "copy", "fence", "publish", "total"} <= set(store)
    assert {"request", "check rows", "reap", "match", "order", "locate", "copy", "fence", "settle",
            "total"} <= set(load)
    for steps in (store, load):
        assert sum(v for k, v in steps.items() if k != "total") <= steps["total"] * 1.01
    assert before < calls[0]["at"] < calls[1]["at"] < after  # one clock for worker and daemon
    assert calls[1]["at"] - calls[0]["at"] >= store["total"]
    for call in calls:  # each step's first start, after the call's start and in order
        starts = call["from"]
        assert all(0 <= starts[k] <= call["ms"]["total"] for k in starts if k != "total")
        assert call["gpu"] == []  # copies on a GPU only (tests/gpu)
    assert calls[0]["from"]["prepare"] < calls[0]["from"]["claim"] < calls[0]["from"]["publish"]
    assert calls[0]["from"]["request"] < calls[0]["from"]["prepare"]
    order = ["request", "check rows", "match", "order", "locate", "copy", "fence", "settle", "reap"]
    assert sorted(order, key=calls[1]["from"].get) == order
