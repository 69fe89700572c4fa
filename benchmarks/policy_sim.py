"""Token hit rate and FLOPs saved by checkpoint placements and eviction, replaying workloads
against the engine.

Each request is replayed as a worker would: load the longest hybrid match into its rows,
"prefill" the rest, then store the prompt's pages and the checkpoints its placement puts
down (the engine keeps every one offered: `offered="all"`). The real `Engine` runs
embedded on CPU tensors, with a host tier only (a disk tier would hold everything), and
budgets of 5%, 20% and 50% of the working set: every distinct KV page of the trace plus
one checkpoint per distinct prompt (the least that hits every request).

Placements, each with the eviction its system uses:
- tiercache: the adapter's (`tiercache.integrations.placement`): the prompt's last full
  page and the branch point (Match.kv_pages: how far another prompt's KV reached past the
  hit); FLOP-aware eviction, and LRU beside it;
- SGLang MambaRadixCache v2-like: a checkpoint every 256 tokens (`mamba_track_interval`)
  and at the prompt's last full page, LRU. SGLang keeps KV and states in two pools of
  fixed sizes, each with its own LRU list; here both share one budget and one LRU;
- vLLM align mode + #37898-like: a checkpoint at the end of each prefill step (chunks of
  2,048 tokens from the hit), at the last full page, and at the branch point, LRU.

Bytes are scaled down 512 times from Qwen3-Next-80B-A3B at TP 1 in bf16, keeping its
ratio of state to KV: a checkpoint (36 gated-delta-net layers: 37.7 MiB) holds as much
as 50 KV pages of 32 tokens (12 attention layers: 768 KiB), and FLOPs come from its shape.
(At 4096 times, as before, a page was 192 bytes, but every memory-tier slot is charged at
least 1 KiB: pages cost 5x their share of the budget and the hit rates collapsed.)

Workloads:
- shared_prefix (seed 001: SGLang's generated-shared-prefix benchmark, made multi-turn):
  groups of conversations share a long system prompt; each turn extends the previous one
  by its answer and a new question. Eight clients run conversations drawn in random order,
  one turn each in turn, so a group's system prompt comes back every ~32 requests.
- agentic: agents with long tool prefixes run sessions that grow by tool results, and
  half the steps branch from an earlier step of the session (retries, parallel calls).

Every placement sees the same trace and budget. (Offering every page and letting
admission keep the end and the branch point, as this benchmark did before, is the
tiercache placement; a checkpoint at every page hit nothing at 5%: the ratio to it is
retired.)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.common import print_summary, print_table
from tiercache.buffers import WorkerBuffers
from tiercache.engine import Engine, EngineConfig
from tiercache.flops import ModelShape, prefix_flops, saved_flops
from tiercache.hashing import Namespace, key_array, page_keys
from tiercache.integrations.placement import plan
from tiercache.layout import BufferSpec, Layout
from tiercache.policy import AdmissionConfig, PolicyConfig
from tiercache.tiers.host import HostConfig

# Qwen3-Next-80B-A3B: 48 layers, every 4th one full attention, 10 of 512 experts + 1 shared
QWEN3_NEXT = ModelShape(
    "qwen3-next-80b-a3b", hidden_size=2048, attention_layers=12, num_heads=16, num_kv_heads=2,
    head_dim=256, mlp_layers=48, intermediate_size=11 * 512, ssm_layers=36, ssm_heads=32,
    ssm_head_dim=128, ssm_state_size=128, ssm_groups=16)
PAGE_TOKENS = 32
SCALE = 512  # real bytes per simulated byte (a page of 1.5 KiB: slots are charged at least 1 KiB)
KV_BYTES_PER_TOKEN = 12 * 2 * 2 * 256 * 2  # attention layers x (K, V) x KV heads x head dim x bf16
STATE_BYTES = 36 * (32 * 128 * 128 * 2 + 3 * (2 * 2048 + 4096) * 2)  # recurrent + conv state, bf16
BUDGETS = (0.05, 0.20, 0.50)
SGLANG_INTERVAL = 256 // PAGE_TOKENS  # pages between tracked states
VLLM_STEP = 2048 // PAGE_TOKENS  # pages per prefill step


@dataclass(frozen=True)
class Ours:
    """The adapter's placement as these traces need it: every prompt here is a multiple of
    the page size and none is repeated, so the page before the last token (kept for
    repeats, `checkpoint_ends`) would only cost room; a prompt's last full page is kept."""

    page_tokens: int = PAGE_TOKENS
    checkpoint_every: int | None = None
    checkpoint_ends: bool = False
    checkpoint_branches: bool = True
    max_checkpoints: int = 8


def tiercache_placement(loaded: int, branch: int, tokens: int, pages: int) -> list[int]:
    return plan(Ours(), loaded * PAGE_TOKENS, branch, tokens, pages)


def sglang_placement(loaded: int, branch: int, tokens: int, pages: int) -> list[int]:
    return sorted({n for n in range(SGLANG_INTERVAL, pages + 1, SGLANG_INTERVAL) if n > loaded}
                  | ({pages} if pages > loaded else set()))


def vllm_placement(loaded: int, branch: int, tokens: int, pages: int) -> list[int]:
    steps = set(range(loaded + VLLM_STEP, pages + 1, VLLM_STEP))
    return sorted(steps | ({pages} if pages > loaded else set())
                  | ({branch} if branch > loaded else set()))


KEEP_ALL = AdmissionConfig(offered="all")
CONFIGS = {  # name: (placement, policy)
    "tiercache flop": (tiercache_placement, PolicyConfig(eviction="flop", admission=KEEP_ALL)),
    "tiercache lru": (tiercache_placement, PolicyConfig(eviction="lru", admission=KEEP_ALL)),
    "sglang-v2-like": (sglang_placement, PolicyConfig(eviction="lru", admission=KEEP_ALL)),
    "vllm-align-like": (vllm_placement, PolicyConfig(eviction="lru", admission=KEEP_ALL)),
}


def sim_layout(max_pages: int) -> Layout:
    page = PAGE_TOKENS * KV_BYTES_PER_TOKEN // SCALE
    return Layout(PAGE_TOKENS, paged=(BufferSpec("kv", max_pages, (page,), "uint8"),),
                  slots=(BufferSpec("state", 1, (STATE_BYTES // SCALE,), "uint8"),), model=QWEN3_NEXT)


# -- workloads ------------------------------------------------------------------------------
def interleave(sessions: list[list[np.ndarray]], clients: int) -> list[np.ndarray]:
    """Requests of sessions run by `clients` clients, one request per client in turn; a
    client that finishes a session starts the next one in the list."""
    queue, active, trace = list(reversed(sessions)), [], []
    while queue or active:
        while queue and len(active) < clients:
            active.append(list(reversed(queue.pop())))
        for session in list(active):
            trace.append(session.pop())
            if not session:
                active.remove(session)
    return trace


def shared_prefix(rng: np.random.Generator, groups=32, per_group=8, turns=3, system=4096,
                  question=256, answer=128, clients=8) -> list[np.ndarray]:
    def text(n):
        return rng.integers(0, 150_000, n)
    conversations = []
    for _ in range(groups):
        prompt = text(system)
        for _ in range(per_group):
            context, turns_of = prompt, []
            for _ in range(turns):
                context = np.concatenate([context, text(question)])
                turns_of.append(context)
                context = np.concatenate([context, text(answer)])
            conversations.append(turns_of)
    order = rng.permutation(len(conversations))
    return interleave([conversations[i] for i in order], clients)


def agentic(rng: np.random.Generator, agents=8, per_agent=8, steps=6, tools=6144, task=512,
            result=384, branch=0.5, clients=8) -> list[np.ndarray]:
    def text(n):
        return rng.integers(0, 150_000, n)
    sessions = []
    for _ in range(agents):
        prefix = text(tools)
        for _ in range(per_agent):
            nodes = [np.concatenate([prefix, text(task)])]
            for _ in range(steps):  # grow from the latest step, or branch from an earlier one
                at = int(rng.integers(0, len(nodes))) if rng.random() < branch else len(nodes) - 1
                nodes.append(np.concatenate([nodes[at], text(result)]))
            sessions.append(nodes)
    order = rng.permutation(len(sessions))
    return interleave([sessions[i] for i in order], clients)


# -- replay ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    hit_rate: float  # tokens loaded / prompt tokens
    flops_saved: float  # prefill FLOPs skipped / prefill FLOPs of every prompt
    seconds: float


def working_set(layout: Layout, chains: list[np.ndarray]) -> int:
    pages = np.unique(np.concatenate(chains), axis=0)
    ends = np.unique(np.stack([c[-1] for c in chains]), axis=0)
    return len(pages) * layout.page_bytes + len(ends) * layout.checkpoint_bytes


def replay(layout: Layout, trace: list[tuple[np.ndarray, int]], budget: int,
           config: tuple) -> Outcome:
    place, policy = config
    host = HostConfig(budget_bytes=budget, slab_bytes=8 * layout.page_bytes, pin=False)
    engine = Engine.open(EngineConfig(host=host, policy=policy))
    worker = WorkerBuffers.bind(layout, [torch.zeros(layout.paged[0].shape, dtype=torch.uint8)],
                                [torch.zeros(layout.slots[0].shape, dtype=torch.uint8)])
    hit = total = saved = cost = 0.0
    start = time.perf_counter()
    for keys, tokens in trace:
        pages = len(keys)
        match = engine.load(worker, keys, range(pages), slot=0).match
        loaded = match.pages
        engine.store(worker, keys, range(pages),
                     {n: 0 for n in place(loaded, match.kv_pages, tokens, pages)})
        hit, total = hit + loaded * PAGE_TOKENS, total + tokens
        saved += float(saved_flops(QWEN3_NEXT, PAGE_TOKENS, loaded))
        cost += float(prefix_flops(QWEN3_NEXT, tokens))
    engine.close()
    return Outcome(hit / total, saved / cost, time.perf_counter() - start)


def run(name: str, prompts: list[np.ndarray], configs: dict[str, tuple]) -> dict:
    root = Namespace("policy-sim", sim_layout(1).fingerprint).root()
    chains = [key_array(page_keys(p, root, PAGE_TOKENS)) for p in prompts]
    layout = sim_layout(max(len(c) for c in chains))
    trace = [(c, len(p)) for c, p in zip(chains, prompts)]
    whole = working_set(layout, chains)
    results = {(b, c): replay(layout, trace, int(whole * b), p)
               for b in BUDGETS for c, p in configs.items()}
    rows = [(f"{b:.0%}", *(results[b, c].hit_rate for c in configs),
             *(results[b, c].flops_saved for c in configs)) for b in BUDGETS]
    print_table(f"{name}: {len(prompts)} requests, working set {whole * SCALE / 2**30:.1f} GiB "
                f"(scaled 1/{SCALE}), {sum(r.seconds for r in results.values()):.0f} s",
                ["host budget", *(f"hit {c}" for c in configs), *(f"flops {c}" for c in configs)], rows)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workloads = {"shared_prefix": shared_prefix(np.random.default_rng(args.seed)),
                 "agentic": agentic(np.random.default_rng(args.seed + 1))}
    summary: dict[str, float] = {}
    peers = ("sglang-v2-like", "vllm-align-like")
    for name, prompts in workloads.items():
        results = run(name, prompts, CONFIGS)
        for budget in BUDGETS:
            pct = f"{budget * 100:.0f}pct"
            for config in CONFIGS:
                summary[f"hit_{pct}_{config.replace(' ', '_').replace('-', '_')}_{name}"] = \
                    results[budget, config].hit_rate
            best_peer = max(results[budget, p].hit_rate for p in peers)
            summary[f"ours_over_best_peer_{pct}_{name}"] = (
                results[budget, "tiercache flop"].hit_rate / best_peer if best_peer else float("nan"))
    print_summary(**summary)


if __name__ == "__main__":
    main()
