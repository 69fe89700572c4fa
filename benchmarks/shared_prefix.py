"""Shared-prefix TTFT on a real hybrid model, and reloading a prefix against recomputing it.

    python -m benchmarks.shared_prefix           # full scale on a GPU, the CPU scale without one
    python -m benchmarks.shared_prefix --quick   # a first check on a GPU (under 3 minutes)

Workload (seed 001: SGLang's generated-shared-prefix benchmark): G groups of P prompts; a
group's prompts share a system prompt of S random tokens and each adds a question of Q;
the G*P prompts come in shuffled order, one at a time (SGLang ran 5 at once, so its TTFT
also holds queueing). Full scale is SGLang's: 50 x 10, S = 10,240, Q = 256. TTFT runs
from the request to its first token (the argmax of the last logits); the 128-token
answers SGLang decoded are skipped, since decoding does not depend on where the prefix
came from.

Three systems take each prompt in turn, so that machine noise falls on all three:
- no cache: one forward pass over the whole prompt (no chunking: the fastest prefill);
- GPU-only cache: `DevicePrefixCache` (device_prefix_cache.py), KV pages and states in
  the worker's own memory, LRU, with a budget B of a tenth of the working set (every
  distinct page and checkpoint the workload stores), so that it must evict;
- tiercache: a daemon process with a device tier of the same B on the worker's GPU, a
  host tier that holds the working set and an LMDB disk tier; the worker's staging rows
  are on its GPU, shared by CUDA IPC (POSIX shared memory on a CPU, no device tier).
Both caches are filled by the same `HybridCacheAdapter.prefill`: forward passes end at a
checkpoint every C tokens (chunked prefill) and at the prompt's end, and a hit loads the
deepest cached checkpoint. S is a multiple of C, so a group's later prompts hit its whole
system prompt; where S is not, hits stop up to C - 1 tokens short. The prompts are
single-turn, so the checkpoints at each prompt's last full page and the page before (one
more forward pass a request, for prompts that come back extended or repeated) are off;
`--end-checkpoints` turns them on.

Reload against recompute (benchmarks/hybrid_reload.py): a prefix of N tokens stored
through the adapter and loaded into a fresh transformers cache (match, copy into the
staging rows, rebuild the cache), from the device tier and then from the host tier,
against prefilling it in chunks. Loaded caches are checked bit for bit.

Scales (`SCALES`): `full` (50 x 10, S = 10,240, Q = 256, C = 2048, N = 4k, 32k, 128k) and
`quick` (10 x 5, N = 4k, 32k) run `QWEN3_NEXT_8` in bf16 (benchmarks/hybrid_model.py);
`cpu` scales everything down (a small model in fp32, 4 x 10 prompts, S = 1024, Q = 32,
C = 256, N = 512, 4k, 16k) and its figures only show that the path works. Progress goes
to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import random
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from benchmarks.common import print_summary, print_table
from benchmarks.device_prefix_cache import DevicePrefixCache
from benchmarks.hybrid_model import CPU_SMALL, QWEN3_NEXT_8, ModelSize, build, clock
from benchmarks.hybrid_reload import reload_row
from service.config import parse_bytes
from service.process import spawn
from tiercache.client import Client, EmbeddedClient
from tiercache.engine import EngineConfig
from tiercache.integrations.transformers import (
    AdapterConfig, CacheSpec, DynamicCache, HybridCacheAdapter)
from tiercache.tiers.device import DeviceConfig
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig

SGLANG_TTFT_RATIO = 507.33 / 890.59  # seed 001: radix cache on / off, Qwen3-Next-80B, TP 4


@dataclass(frozen=True)
class Scale:
    name: str
    model: ModelSize
    dtype: torch.dtype
    groups: int
    prompts: int  # per group
    system_tokens: int
    question_tokens: int
    checkpoint_tokens: int  # C: a checkpoint (and the end of a forward pass) every C tokens
    reload_tokens: tuple[int, ...]  # the second stands for 32k in the summary
    host_budget: str  # tiercache's host tier: holds the working set
    recompute_chunk: int  # tokens per forward pass when recomputing a long prefix
    page_tokens: int = 16
    gpu_cache_share: float = 0.1  # GPU-only cache budget, as a share of the working set


SCALES = {
    "full": Scale("full", QWEN3_NEXT_8, torch.bfloat16, 50, 10, 10240, 256, 2048,
                  (4096, 32768, 131072), "24GiB", 8192),
    "quick": Scale("quick", QWEN3_NEXT_8, torch.bfloat16, 10, 5, 10240, 256, 2048,
                   (4096, 32768), "8GiB", 8192),
    "cpu": Scale("cpu", CPU_SMALL, torch.float32, 4, 10, 1024, 32, 256,
                 (512, 4096, 16384), "1GiB", 2048),
}


@dataclass(frozen=True)
class Request:
    ttft: float
    prompt_tokens: int
    computed: int
    loaded: int
    token: int  # the first token
    loaded_from: dict = dataclasses.field(default_factory=dict)  # bytes by tier


def log(message: str) -> None:
    print(f"[shared_prefix {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- workload ------------------------------------------------------------------------------
def workload(scale: Scale, vocab: int, seed: int) -> list[torch.Tensor]:
    """The shuffled prompts, [1, S + Q] each."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(scale.groups):
        system = torch.randint(0, vocab, (1, scale.system_tokens), generator=gen)
        prompts += [torch.cat([system, torch.randint(0, vocab, (1, scale.question_tokens),
                                                     generator=gen)], dim=1)
                    for _ in range(scale.prompts)]
    random.Random(seed).shuffle(prompts)
    return prompts


def working_set(adapter: HybridCacheAdapter, prompts: list[torch.Tensor]) -> int:
    """Bytes of every distinct page and checkpoint that prefilling `prompts` stores."""
    pages, checkpoints = set(), set()
    for prompt in prompts:
        keys = adapter.keys(prompt[0])
        pages.update(keys)
        _, ends = adapter._plan(0, prompt.shape[1], len(keys))
        checkpoints.update(keys[end // adapter.config.page_tokens - 1] for end in ends)
    return len(pages) * adapter.layout.page_bytes + len(checkpoints) * adapter.layout.checkpoint_bytes


# -- the systems ---------------------------------------------------------------------------
def no_cache(model: torch.nn.Module, prompt: torch.Tensor) -> Request:
    device = prompt.device
    start = clock(device)
    with torch.no_grad():
        out = model(input_ids=prompt, past_key_values=DynamicCache(config=model.config),
                    use_cache=True, logits_to_keep=1)
    token = int(out.logits[0, -1].argmax())
    return Request(clock(device) - start, prompt.shape[1], prompt.shape[1], 0, token)


def cached(adapter: HybridCacheAdapter, model: torch.nn.Module, prompt: torch.Tensor) -> Request:
    start = clock(prompt.device)
    run = adapter.prefill(model, prompt, last_only=True)
    token = int(run.logits[0, -1].argmax())
    return Request(clock(prompt.device) - start, prompt.shape[1], run.computed_tokens,
                   run.loaded_tokens, token, run.load.bytes_from)


@contextmanager
def tiercache(scale: Scale, model: torch.nn.Module, config: AdapterConfig, device_budget: int,
              embedded: bool) -> Iterator[tuple[HybridCacheAdapter, Client | EmbeddedClient]]:
    """An adapter over a daemon process (or, with `embedded`, an engine in this process):
    on a GPU a device tier of `device_budget`, a host tier of scale.host_budget, and an
    LMDB disk tier in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="tiercache-bench-") as data_dir:
        if embedded:
            client = EmbeddedClient(EngineConfig(
                host=HostConfig(budget_bytes=parse_bytes(scale.host_budget)),
                device=DeviceConfig(budget_bytes=device_budget) if device_budget else None,
                disk=DiskConfig(f"{data_dir}/lmdb", map_size=64 << 30, sync=False)))
            with HybridCacheAdapter.for_model(model, client, config) as adapter:
                yield adapter, client
            client.close()
            return
        with spawn(data_dir, "--device-budget", str(device_budget), "--host-budget",
                   scale.host_budget, "--disk-map-size", "64GiB", "--no-disk-sync",
                   "--no-flush-on-exit", forward_output=True) as (address, _):
            client = Client(address)
            with HybridCacheAdapter.for_model(model, client, config) as adapter:
                yield adapter, client
            client.close()


def serve(systems: dict, prompts: list[torch.Tensor]) -> dict[str, list[Request]]:
    """Every prompt through every system in turn; progress on stderr."""
    results: dict[str, list[Request]] = {name: [] for name in systems}
    last = time.perf_counter()
    for n, prompt in enumerate(prompts, 1):
        for name, system in systems.items():
            results[name].append(system(prompt))
        if n == len(prompts) or time.perf_counter() - last > 10:
            last = time.perf_counter()
            log(f"{n}/{len(prompts)} requests; mean TTFT so far: " + ", ".join(
                f"{name} {1e3 * statistics.mean(r.ttft for r in rs):.1f} ms"
                for name, rs in results.items()))
    return results


def ttft_row(name: str, requests: list[Request], reference: list[Request]) -> list:
    ttft = np.array([r.ttft for r in requests]) * 1e3
    prompt = sum(r.prompt_tokens for r in requests)
    same = sum(a.token == b.token for a, b in zip(requests, reference))
    tiers: dict = {}
    for r in requests:
        for tier, nbytes in r.loaded_from.items():
            tiers[tier] = tiers.get(tier, 0) + nbytes
    loaded = sum(tiers.values())
    return [name, len(requests), float(ttft.mean()), float(np.percentile(ttft, 50)),
            float(np.percentile(ttft, 99)), sum(r.computed for r in requests),
            sum(r.loaded for r in requests) / prompt,
            sum(r.loaded > 0 for r in requests) / len(requests),
            " ".join(f"{t.name.lower()} {n / loaded:.0%}" for t, n in sorted(tiers.items())) or "-",
            f"{same}/{len(requests)}"]


# -- main ------------------------------------------------------------------------------------
def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_const", dest="scale", const="full",
                      help="SGLang's scale (the default with a GPU)")
    size.add_argument("--quick", action="store_const", dest="scale", const="quick",
                      help="a first check on a GPU: 10 x 5 prompts, prefixes of 4k and 32k")
    size.add_argument("--cpu", action="store_const", dest="scale", const="cpu",
                      help="the scaled-down run (the default without a GPU)")
    parser.add_argument("--embedded", action="store_true",
                        help="tiercache's engine in this process instead of a daemon")
    parser.add_argument("--end-checkpoints", action="store_true",
                        help="also checkpoint at each prompt's last full page and the page before "
                             "(AdapterConfig.checkpoint_ends): one more forward pass a request")
    parser.add_argument("--groups", type=int, help="groups of prompts (fewer: a shorter run)")
    parser.add_argument("--gpu-cache-share", type=float,
                        help="GPU-only cache budget as a share of the working set (default 0.1)")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args()


def pick_scale(args: argparse.Namespace, device: torch.device) -> Scale:
    scale = SCALES[args.scale or ("full" if device.type == "cuda" else "cpu")]
    if args.gpu_cache_share is not None:
        scale = dataclasses.replace(scale, gpu_cache_share=args.gpu_cache_share)
    if args.groups is not None:
        scale = dataclasses.replace(scale, groups=args.groups)
    return scale


def load_model(scale: Scale, device: torch.device, max_tokens: int) -> torch.nn.Module:
    log(f"scale {scale.name} on {device}: building {scale.model.name} in {scale.dtype}")
    model = build(scale.model, device, scale.dtype, max_tokens)
    log(f"experts: {model.config._experts_implementation}, attention: "
        f"{model.config._attn_implementation}, gated delta rule: "
        f"{'fla' if importlib.util.find_spec('fla') else 'torch fallback (no fla)'}")
    return model


def main() -> None:
    args = parse()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scale = pick_scale(args, device)
    prompt_tokens = scale.system_tokens + scale.question_tokens
    longest = max(prompt_tokens, *scale.reload_tokens)
    model = load_model(scale, device, longest + 1024)
    model_id, every = f"{scale.model.name} seed 0", scale.checkpoint_tokens // scale.page_tokens
    small = AdapterConfig(model_id, scale.page_tokens, prompt_tokens, every, args.end_checkpoints)
    big = AdapterConfig(model_id, scale.page_tokens, longest, every, args.end_checkpoints)
    prompts = [p.to(device) for p in workload(scale, model.config.vocab_size, args.seed)]
    warmup = [p.to(device) for p in workload(scale, model.config.vocab_size, args.seed + 1000)[:2]]
    gpu_only, total = gpu_only_cache(model, small, scale, prompts)
    budget = gpu_only.worker.budget
    log(f"working set {total / 2**30:.2f} GiB; GPU budget (GPU-only cache, tiercache's device "
        f"tier) {budget / 2**30:.2f} GiB; tiercache host tier {scale.host_budget}")
    with tiercache(scale, model, big, budget, args.embedded) as (ours, client):
        reloads = [reload_or_why(ours, client, model, n, scale.recompute_chunk,
                                 1 if n == longest else 3) for n in scale.reload_tokens]
        systems = {"no cache": lambda p: no_cache(model, p),
                   "GPU-only cache": lambda p: cached(gpu_only, model, p),
                   "tiercache": lambda p: cached(ours, model, p)}
        serve(systems, warmup)  # kernels, allocators, registrations: not timed
        results = serve(systems, prompts)
        tiers = {t.tier.name: t for t in client.stats().tiers}
    report(scale, device, results, reloads, budget, total, gpu_only.worker.evicted)
    print("tiercache at the end: " + ", ".join(
        f"{name} {t.entries} entries, {t.used_bytes / 2**30:.2f} GiB" for name, t in tiers.items()))
    if device.type == "cuda":
        print(f"peak GPU memory allocated: {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")


def reload_or_why(adapter: HybridCacheAdapter, client, model: torch.nn.Module, tokens: int,
                  chunk: int, prefills: int) -> list:
    """A reload row, or what went wrong in its place: one failure costs the row, not the run."""
    try:
        return reload_row(adapter, client, model, tokens, chunk, 3, prefills)
    except Exception as error:  # noqa: BLE001 (reported in the table and on stderr)
        log(f"reload of {tokens} tokens failed: {error!r}")
        return [tokens, "", "", f"failed: {type(error).__name__}", float("nan"), "", "", ""]


def gpu_only_cache(model: torch.nn.Module, config: AdapterConfig, scale: Scale,
                   prompts: list[torch.Tensor]) -> tuple[HybridCacheAdapter, int]:
    """The GPU-only cache with a budget of scale.gpu_cache_share of the working set (found
    with a cache of no budget, which only hashes and plans), and the working set."""
    spec = CacheSpec.probe(model, lambda: DynamicCache(config=model.config))
    layout = spec.layout(config.page_tokens, config.max_pages)
    device = next(model.parameters()).device

    def adapter(budget: int) -> HybridCacheAdapter:
        return HybridCacheAdapter(DevicePrefixCache(layout, budget, device), spec, config,
                                  lambda: DynamicCache(config=model.config), device)
    total = working_set(adapter(0), prompts)
    return adapter(int(scale.gpu_cache_share * total)), total


def report(scale: Scale, device: torch.device, results: dict, reloads: list, budget: int,
           total: int, evicted: int) -> None:
    rows = [ttft_row(name, rs, results["no cache"]) for name, rs in results.items()]
    base = rows[0][2]
    for row in rows:
        row.insert(5, row[2] / base)
    print_table(f"shared_prefix ({scale.name}: {scale.groups} x {scale.prompts} prompts, system "
                f"{scale.system_tokens} + question {scale.question_tokens} tokens, "
                f"{scale.model.name}, {str(scale.dtype).removeprefix('torch.')}, {device.type})",
                ["system", "requests", "TTFT mean ms", "p50 ms", "p99 ms", "vs no cache",
                 "prefill tokens", "token hit rate", "request hits", "loaded from",
                 "1st token = no cache"],
                rows + [["SGLang radix cache (seed 001)", 500, "", "", "", SGLANG_TTFT_RATIO,
                         "", "", "", "", ""]])
    print(f"GPU budget: {budget / 2**30:.2f} GiB = {scale.gpu_cache_share:.0%} of the working set "
          f"({total / 2**30:.2f} GiB) for the GPU-only cache ({evicted} entries evicted) and for "
          f"tiercache's device tier (GPU only), beside its host tier of {scale.host_budget}")
    print_table(f"reload vs recompute ({scale.name}: a stored prefix into a fresh cache, against "
                f"a chunked prefill of {scale.recompute_chunk} tokens a pass)",
                ["prefix tokens", "recompute ms", "device tier ms", "host tier ms",
                 "speedup (host)", "MiB", "host GB/s", "bit-exact"], reloads)
    ratio = rows[2][2] / base
    print_summary(scale=scale.name, ttft_ratio=ratio, ttft_ratio_gpu_only=rows[1][2] / base,
                  hit_rate_tiercache=rows[2][7], hit_rate_gpu_only=rows[1][7],
                  reload_speedup_32k=reloads[1][4], reload_32k_tokens=reloads[1][0],
                  sglang_ttft_ratio=SGLANG_TTFT_RATIO)


if __name__ == "__main__":
    main()
