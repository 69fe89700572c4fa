"""The vLLM connector's data path on CUDA tensors shaped like vLLM 0.32's KV cache, through
a real daemon that opens them by CUDA IPC (vLLM itself is not needed): bit-exact round
trips for attention KV and Mamba states in both layouts vLLM uses, and the load and save
bandwidth beside one bulk copy of the same bytes on the same GPU, printed as a table.
Runs only where there is a GPU (make test-gpu)."""

from __future__ import annotations

import pytest
import torch

from tests.service.daemon import running_daemon
from tests.tiercache.integrations.vllm.datapath import Drill, bulk_copy_seconds, hybrid_shape
from tiercache.client import Client

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

# Qwen3-Next-like pages at vLLM's hybrid block size: 4 layers a group, 2 KV heads of 256
# per rank, 272-token blocks (attention pages ~1 MiB a layer, padded Mamba states alike)
BLOCKS, PAGES = 384, 64
SHAPE = dict(block_size=272, layers=4, heads=2, head_size=256)


@pytest.mark.parametrize("block_outer", [False, True], ids=["layer-outer", "block-outer"])
def test_vllm_shaped_cuda_caches_round_trip_and_their_bandwidth(tmp_path, block_outer):
    shape = hybrid_shape(BLOCKS, block_outer=block_outer, **SHAPE)
    flags = ["--device-budget", "4GiB", "--host-budget", "4GiB", "--no-disk"]
    with running_daemon(tmp_path, *flags) as (address, _):
        client = Client(address, timeout=120)
        drill = Drill.start(client, shape, "cuda", f"gpu-{block_outer}")
        source = list(range(1, PAGES + 1))
        states = {1: PAGES + 1, 2: PAGES + 2}
        drill.fill(0, source, seed=1)
        for group, block in states.items():
            drill.fill(group, [block], seed=10 + group)
        torch.cuda.synchronize()
        want = drill.rows(0, source), {g: drill.rows(g, [b]) for g, b in states.items()}
        targets = list(range(BLOCKS - PAGES, BLOCKS))
        new_states = {1: PAGES + 3, 2: PAGES + 4}
        # a round trip of another prompt first: the copy kernels compile outside the timing
        drill.tokens, tokens = drill.tokens[::-1], drill.tokens
        drill.save(100, 2, source[:2], states)
        assert drill.load("warm-up", 2, 0, targets[:2], new_states)[1] == set()
        drill.tokens = tokens
        save_s = drill.save(0, PAGES, source, states)
        # into other blocks, poisoned first: all pages and both states, then bit for bit
        drill.fill(0, targets, seed=99)
        for group, block in new_states.items():
            drill.fill(group, [block], seed=98)
        torch.cuda.synchronize()
        load_s, failed = drill.load("b", PAGES, 0, targets, new_states)
        assert failed == set()
        assert all(torch.equal(a, b) for a, b in zip(drill.rows(0, targets), want[0], strict=True))
        for group, block in new_states.items():
            assert all(torch.equal(a, b) for a, b in
                       zip(drill.rows(group, [block]), want[1][group], strict=True))
        moved = sum(t.numel() for t in want[0]) + sum(t.numel() for v in want[1].values()
                                                     for t in v)
        bulk_s = bulk_copy_seconds(moved, "cuda")
        drill.close()
    layout = "block-outer" if block_outer else "layer-outer"
    print(f"\n{torch.cuda.get_device_name()}: {PAGES} blocks x {SHAPE['layers']} layers + 2 states "
          f"({moved / 2**20:.0f} MiB), {layout}")
    print(f"{'path':<32}{'seconds':>10}{'GB/s':>10}")
    for name, seconds in (("save (worker -> device tier)", save_s),
                          ("load (device tier -> worker)", load_s),
                          ("one bulk device copy (peer)", bulk_s)):
        print(f"{name:<32}{seconds:>10.4f}{moved / seconds / 1e9:>10.1f}")
