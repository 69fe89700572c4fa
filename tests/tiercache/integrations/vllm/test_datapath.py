"""The connector's data path on CPU tensors in vLLM's layouts, through a real daemon: what
a worker saves from some blocks comes back bit for bit into other blocks, attention KV
and each Mamba group's state alike, and a load the cache cannot fully serve fails as a
whole. Needs no vLLM (datapath builds the layouts); tests/gpu/test_vllm_datapath runs
the same on CUDA tensors."""

from __future__ import annotations

import pytest
import torch

from tests.service.daemon import running_daemon
from tests.tiercache.integrations.vllm.datapath import Drill, hybrid_shape
from tiercache.client import Client
from tiercache.integrations.vllm.pages import group_runs


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("daemon")) as (address, _):
        yield address


@pytest.mark.parametrize("block_outer", [False, True], ids=["layer-outer", "block-outer"])
def test_saved_blocks_reload_bit_for_bit_into_other_blocks(daemon, block_outer):
    client = Client(daemon)
    drill = Drill.start(client, hybrid_shape(64, block_outer=block_outer), "cpu",
                        f"datapath-{block_outer}")
    # a request's 5 attention blocks, scattered, and each Mamba group's state block
    kv, states = [3, 7, 1, 9, 12], {1: 20, 2: 21}
    drill.fill(0, kv, seed=1)
    for group, block in states.items():
        drill.fill(group, [block], seed=10 + group)
    saved_kv, saved_states = drill.rows(0, kv), {g: drill.rows(g, [b]) for g, b in states.items()}
    drill.save(0, 5, kv, states)
    # the whole engine group sees the hit: KV pages 1..5 and both states after page 5
    assert client.group(f"datapath-{block_outer}").match(drill.tokens[:5 * 16]).pages == 5
    # another request has pages 1..2 itself and loads 3..5 and the states into new blocks
    targets, new_states = [30, 31, 32], {1: 40, 2: 41}
    drill.fill(0, targets, seed=99)  # poison: whatever was there must be replaced
    for group, block in new_states.items():
        drill.fill(group, [block], seed=98)
    _, failed = drill.load("b", 5, 2, targets, new_states)
    assert failed == set()
    loaded = drill.rows(0, targets)
    assert all(torch.equal(a, b[2:]) for a, b in zip(loaded, saved_kv, strict=True))
    for group, block in new_states.items():
        assert all(torch.equal(a, b) for a, b in
                   zip(drill.rows(group, [block]), saved_states[group], strict=True))
    # blocks nobody loaded into kept their bytes (rows are blocks, not more)
    assert all(torch.equal(a, b) for a, b in zip(drill.rows(0, kv), saved_kv, strict=True))
    drill.close()


def test_a_load_the_cache_cannot_serve_whole_fails_as_a_whole(daemon):
    client = Client(daemon)
    drill = Drill.start(client, hybrid_shape(64), "cpu", "datapath-short")
    drill.fill(0, [1, 2, 3], seed=1)
    drill.fill(1, [4], seed=2)
    drill.fill(2, [5], seed=3)
    drill.save(0, 3, [1, 2, 3], {1: 4, 2: 5})
    # asked for 4 pages: KV for 3 only, and no state after 4
    _, failed = drill.load("too-long", 4, 0, [10, 11, 12, 13], {1: 14, 2: 15})
    assert failed == {"too-long"}
    # a state missing in one Mamba group alone fails the load too
    drill.save(1, 2, [1, 2], {1: 6})
    _, failed = drill.load("half-state", 2, 0, [10, 11], {1: 14, 2: 15})
    assert failed == {"half-state"}
    drill.close()


def test_each_cache_group_is_the_rows_vllm_says_it_is():
    # layer-outer: every layer a buffer of num_blocks pages from its region's start
    shape = hybrid_shape(64)
    runs = group_runs(shape, shape.groups[1])
    page = 2 * 16 * 2 * 64 * 2
    assert [(r.offset, r.row_bytes) for r in runs.values()] == [(0, page), (page * 64, page)]
    # block-outer: one buffer of whole blocks (the pages of all the group's layers)
    shape = hybrid_shape(64, block_outer=True)
    runs = group_runs(shape, shape.groups[2])
    assert [(r.offset, r.row_bytes) for r in runs.values()] == [(0, 2 * page)]
