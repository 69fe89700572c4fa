"""A transformers worker in its own process, over a real daemon, driven by
test_transformers_daemon.

    python -m tests.tiercache.integrations.hf_worker store ADDRESS OUT
    python -m tests.tiercache.integrations.hf_worker continue ADDRESS OUT

store: prefills FIRST through an adapter over the daemon (one pass that keeps the state
after page 4), waits for its store of pages 1-4 and that state, and saves what it
computed and stored to OUT/store.pt.
continue: a fresh adapter poisons its staging rows (a row the load leaves unwritten turns
the logits to NaN), matches SECOND, prefills it (the hit loaded, the rest computed and
counted by a forward hook), decodes 5 greedy tokens from that cache and saves all of it
to OUT/continue.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.tiercache.integrations.tiny import PAGE, decode, tiny_qwen3_next, tokens
from tiercache.client import Client
from tiercache.integrations.transformers import AdapterConfig, HybridCacheAdapter

CONFIG = AdapterConfig(model_id="tiny-qwen3-next@seed0", page_tokens=PAGE, max_tokens=128)
FIRST = tokens(37, seed=1)  # 4 full pages and 5 tokens
SECOND = torch.cat([FIRST[:, :35], tokens(10, seed=3)], dim=1)  # shares 4 pages and 3 tokens


def store(adapter: HybridCacheAdapter, model: torch.nn.Module) -> dict:
    run = adapter.prefill(model, FIRST)
    return {"chunks": list(run.chunks), "logits": run.logits,
            "checkpoints": list(run.store.result().checkpoints)}


def resume(adapter: HybridCacheAdapter, model: torch.nn.Module) -> dict:
    for buffer in (*adapter.staging.paged.values(), *adapter.staging.slots.values()):
        buffer.fill_(float("nan"))
    match = adapter.match(SECOND[0, :-1])
    calls: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    run = adapter.prefill(model, SECOND)
    hook.remove()
    return {"match": [match.pages, [t.name for t in match.page_tiers], match.checkpoint_tier.name],
            "bytes_from": {tier.name: n for tier, n in run.load.bytes_from.items()},
            "loaded": run.loaded_tokens, "calls": calls, "logits": run.logits,
            "greedy": decode(model, run.cache, run.logits)}


def main(mode: str, address: str, out: Path) -> None:
    model = tiny_qwen3_next()
    with HybridCacheAdapter.for_model(model, Client(address), CONFIG) as adapter:
        result = store(adapter, model) if mode == "store" else resume(adapter, model)
    torch.save(result, out / f"{mode}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
