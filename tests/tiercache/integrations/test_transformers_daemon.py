"""The adapter as deployed: worker processes over a real daemon, the prefix pushed to disk
and the daemon restarted in between. A second process's continuation is bit-identical to
continuing from the same prefix kept in memory here, within float32 rounding of a full
prefill, and computes exactly the tokens after the hit."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.23")

from tests.service.daemon import ROOT, running_daemon  # noqa: E402
from tests.tiercache.integrations.hf_worker import CONFIG, FIRST, SECOND  # noqa: E402
from tests.tiercache.integrations.tiny import (  # noqa: E402
    captured, continued, full_prefill, greedy, tiny_qwen3_next)
from tiercache.client import Client  # noqa: E402
from tiercache.integrations.transformers import CacheSpec  # noqa: E402


def worker(mode: str, address: str, out) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.tiercache.integrations.hf_worker", mode,
                           address, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(out / f"{mode}.pt", weights_only=True)


def entries(address: str) -> dict[str, int]:
    return {t.tier.name: t.entries for t in Client(address).stats().tiers}


def test_a_prefix_from_a_restarted_daemons_disk_continues_bit_exactly(tmp_path):
    model = tiny_qwen3_next()
    layout = CacheSpec.probe(model, lambda: transformers.DynamicCache(config=model.config)).layout(
        CONFIG.page_tokens, CONFIG.rows, CONFIG.slots)

    # Process 1 prefills 37 tokens in one pass that keeps the state after page 4 on the
    # way; pages 1-4 and that state are stored. It computed what this process does.
    with running_daemon(tmp_path) as (address, _):
        stored = worker("store", address, tmp_path)
    assert (stored["chunks"], stored["checkpoints"]) == ([37], [4])
    fresh = transformers.DynamicCache(config=model.config)
    assert torch.equal(stored["logits"], continued(model, fresh, FIRST, cuts=(32,)))

    # SIGTERM flushed the host tier to LMDB; the new daemon has the 5 entries on disk only.
    with running_daemon(tmp_path) as (address, _):
        assert entries(address) == {"HOST": 0, "DISK": 5}
        # Process 2 shares 35 tokens with process 1: the hit stops at the checkpoint after
        # page 4 and comes from disk, all of it.
        resumed = worker("continue", address, tmp_path)
    assert resumed["match"] == [4, ["DISK"] * 4, "DISK"]
    assert resumed["bytes_from"] == {"DISK": 4 * layout.page_bytes + layout.checkpoint_bytes}

    # Exactly the 13 tokens after the hit were computed, in one pass that keeps the state
    # after page 5 (8 tokens in).
    assert (resumed["loaded"], resumed["calls"]) == (32, [13])

    # Bit-identical to the same checkpoint kept in memory, run on the same way; within
    # float32 rounding of a full prefill; and the same greedy continuation as from scratch.
    kept = continued(model, captured(model, FIRST, 32), SECOND[:, 32:], cuts=(8,))
    ours = resumed["logits"]
    assert torch.equal(ours, kept), f"max |delta| = {(ours - kept).abs().max()}"
    torch.testing.assert_close(ours, full_prefill(model, SECOND)[:, 32:], atol=1e-4, rtol=0)
    assert torch.equal(resumed["greedy"], greedy(model, SECOND))
