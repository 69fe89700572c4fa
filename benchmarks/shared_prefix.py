"""Shared-prefix TTFT on real hybrid models, and reloading a prefix against recomputing it.

    python -m benchmarks.shared_prefix --quick              # a first check on a GPU
    python -m benchmarks.shared_prefix --full --groups 10   # the GPU run (RESULTS.md)
    python -m benchmarks.shared_prefix --profile            # + a per-step breakdown

Workload (seed 001: SGLang's generated-shared-prefix benchmark): G groups of P prompts; a
group's prompts share a system prompt of S random tokens and each adds a question of Q;
the G*P prompts come in shuffled order, one at a time. Full scale is SGLang's: 50 x 10,
S = 10,240, Q = 256. TTFT runs from the request to its first token (the argmax of the last
logits); decoding does not depend on where the prefix came from and is skipped.

Systems, each prompt through all of them in turn (machine noise falls on all):
- no cache: one forward pass over the whole prompt: the best for a miss;
- ideal: an unbounded prefix cache in the worker's own GPU memory (`DevicePrefixCache`
  with room for the whole working set: it never evicts, offloads nothing, and a hit is a
  GPU-to-GPU copy): the best any cache does for a hit;
- tiercache: a daemon process with a device tier of B (a tenth of the working set) on the
  worker's GPU, a host tier that holds the working set and an LMDB disk tier; the worker's
  staging rows are on its GPU, shared by CUDA IPC (shared memory on a CPU);
- with `--gpu-only`, also a GPU-resident cache bounded to B (LRU), as before.
Both caches run the same `HybridCacheAdapter.prefill`: one forward pass that keeps the
states at the planned boundaries (the prompt's last full page, the branch point, every C
tokens; not the page before the last token: no prompt here is repeated), stores behind
the return. Hits and misses are reported apart; a group's first prompt is a miss for all.

Models (`--model`, both by default): Qwen3-Next's MoE layer shapes and Qwen3.5's dense
ones, each cut to 8 layers (benchmarks/hybrid_model.py), bf16 on a GPU, small widths in
fp32 on a CPU. The header says which kernels ran (flash-linear-attention or the torch
fallback) and whether checkpoints came from one pass. Every timed path runs once first,
untimed, on prompts of the same shapes (a group's miss, branch and hit; the reload's
recompute and loads), so kernel compilation and autotuning never land in a figure.

Reload against recompute (benchmarks/hybrid_reload.py): a prefix of N tokens stored
through the adapter and loaded into a fresh transformers cache, from the device tier and
then the host tier, against a warmed chunked prefill of it. Loaded caches are checked bit
for bit. Progress goes to stderr; with $OUT set, each model's tables also go to
$OUT/shared_prefix-MODEL.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import dataclasses
import inspect
import io
import os
import random
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from benchmarks.common import print_table
from benchmarks.device_prefix_cache import DevicePrefixCache
from benchmarks.hybrid_model import MODELS, ModelSize, build, clock
from benchmarks.hybrid_reload import reload_row
from benchmarks.shared_prefix_report import (
    Request, profile_table, progress, summary, targets, ttft_table)
from tiercache_service.config import parse_bytes
from tiercache_service.process import spawn
from tiercache.client import Client, EmbeddedClient
from tiercache.engine import EngineConfig
from tiercache.integrations.transformers import (
    AdapterConfig, CacheSpec, DynamicCache, HybridCacheAdapter)
from tiercache.tiers.device import DeviceConfig
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig


@dataclass(frozen=True)
class Scale:
    name: str
    gpu: bool  # the GPU model sizes in bf16, or the CPU ones in fp32
    groups: int
    prompts: int  # per group
    system_tokens: int
    question_tokens: int
    checkpoint_tokens: int  # C: a checkpoint every C tokens (0: ends and branch points only)
    reload_tokens: tuple[int, ...]  # the second stands for 32k in the summary
    host_budget: str  # tiercache's host tier (set to hold the working set)
    recompute_chunk: int  # tokens per forward pass when recomputing a long prefix
    page_tokens: int = 16
    gpu_cache_share: float = 0.1  # tiercache's device tier, as a share of the working set

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.gpu else torch.float32


SCALES = {
    "full": Scale("full", True, 50, 10, 10240, 256, 2048, (4096, 32768), "24GiB", 8192),
    "quick": Scale("quick", True, 10, 5, 10240, 256, 2048, (4096, 32768), "8GiB", 8192),
    "cpu": Scale("cpu", False, 4, 6, 1024, 32, 256, (512, 4096), "1GiB", 2048),
}


def log(message: str) -> None:
    print(f"[shared_prefix {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- workload ------------------------------------------------------------------------------
def workload(scale: Scale, vocab: int, seed: int, groups: int | None = None,
             shuffle: bool = True) -> list[tuple[torch.Tensor, bool]]:
    """(prompt [1, S + Q], whether it is the first of its group to come), in order."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for group in range(groups or scale.groups):
        system = torch.randint(0, vocab, (1, scale.system_tokens), generator=gen)
        prompts += [(group, torch.cat([system, torch.randint(
            0, vocab, (1, scale.question_tokens), generator=gen)], dim=1))
            for _ in range(scale.prompts)]
    if shuffle:
        random.Random(seed).shuffle(prompts)
    seen: set[int] = set()
    out = []
    for group, prompt in prompts:
        out.append((prompt, group not in seen))
        seen.add(group)
    return out


def working_set(adapter: HybridCacheAdapter, scale: Scale, prompts: list) -> int:
    """Bytes of every distinct page and checkpoint that prefilling `prompts` stores."""
    pages, checkpoints = set(), set()
    branch = scale.system_tokens // scale.page_tokens
    for prompt, _ in prompts:
        keys = adapter.keys(prompt[0])
        pages.update(keys)
        for count in adapter.plan(0, branch, prompt.shape[1], len(keys)):
            checkpoints.add(keys[count - 1])
    return len(pages) * adapter.layout.page_bytes + len(checkpoints) * adapter.layout.checkpoint_bytes


# -- the systems ---------------------------------------------------------------------------
def no_cache(model: torch.nn.Module, prompt: torch.Tensor, first: bool) -> Request:
    start = clock(prompt.device)
    with torch.no_grad():
        out = model(input_ids=prompt, past_key_values=DynamicCache(config=model.config),
                    use_cache=True, logits_to_keep=1)
    token = int(out.logits[0, -1].argmax())
    return Request(clock(prompt.device) - start, prompt.shape[1], prompt.shape[1], 0, token, first)


def cached(adapter: HybridCacheAdapter, model: torch.nn.Module, prompt: torch.Tensor,
           first: bool) -> Request:
    start = clock(prompt.device)
    run = adapter.prefill(model, prompt, last_only=True)
    token = int(run.logits[0, -1].argmax())
    return Request(clock(prompt.device) - start, prompt.shape[1], run.computed_tokens,
                   run.loaded_tokens, token, first, run.load.bytes_from)


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


def device_cache(model: torch.nn.Module, config: AdapterConfig, budget: int) -> HybridCacheAdapter:
    """A GPU-resident prefix cache of `budget` bytes in the worker's memory."""
    spec = CacheSpec.probe(model, lambda: DynamicCache(config=model.config))
    layout = spec.layout(config.page_tokens, config.rows, config.slots)
    device = next(model.parameters()).device
    adapter = HybridCacheAdapter(DevicePrefixCache(layout, budget, device), spec, config,
                                 lambda: DynamicCache(config=model.config), device)
    adapter.capture_for(model)
    return adapter


def serve(systems: dict, prompts: list) -> dict[str, list[Request]]:
    """Every prompt through every system in turn; progress on stderr."""
    results: dict[str, list[Request]] = {name: [] for name in systems}
    last = time.perf_counter()
    for n, (prompt, first) in enumerate(prompts, 1):
        for name, system in systems.items():
            results[name].append(system(prompt, first))
        if n == len(prompts) or time.perf_counter() - last > 10:
            last = time.perf_counter()
            log(f"{n}/{len(prompts)} requests; mean TTFT so far: {progress(results)}")
    return results


def profiled(adapter: HybridCacheAdapter, model: torch.nn.Module, prompt: torch.Tensor
             ) -> tuple[list[tuple[str, float]], float]:
    """The marks of one prefill, and how long its store then ran behind it."""
    adapter.flush()
    adapter.profile = []
    run = adapter.prefill(model, prompt, last_only=True)
    int(run.logits[0, -1].argmax())
    marks, adapter.profile = list(adapter.profile), None
    start = time.perf_counter()
    if run.store is not None:
        run.store.result()
    return marks, time.perf_counter() - start


def profile(adapters: dict[str, HybridCacheAdapter], model: torch.nn.Module, scale: Scale,
            vocab: int, seed: int) -> None:
    """A miss (a new group's first prompt) and a hit (its second) through each cache."""
    group = [p for p, _ in workload(scale, vocab, seed, groups=1, shuffle=False)]
    device = next(model.parameters()).device
    marks, stores = {}, {}
    for name, adapter in adapters.items():
        for kind, prompt in (("miss", group[0]), ("hit", group[1])):
            # the ideal's hit needs the group's branch point first: run the second once
            if kind == "hit":
                adapter.prefill(model, group[2].to(device), last_only=True)
            marks[f"{name} {kind}"], stores[f"{name} {kind}"] = profiled(adapter, model,
                                                                        prompt.to(device))
    profile_table(f"per-step breakdown ({scale.name}: GPU-synchronised marks inside prefill)",
                  marks, stores)


# -- main ------------------------------------------------------------------------------------
def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_const", dest="scale", const="full",
                      help="SGLang's scale (the default with a GPU)")
    size.add_argument("--quick", action="store_const", dest="scale", const="quick",
                      help="a first check on a GPU: 10 x 5 prompts")
    size.add_argument("--cpu", action="store_const", dest="scale", const="cpu",
                      help="the scaled-down run (the default without a GPU)")
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--embedded", action="store_true",
                        help="tiercache's engine in this process instead of a daemon")
    parser.add_argument("--gpu-only", action="store_true",
                        help="also a GPU-resident cache bounded to tiercache's device budget")
    parser.add_argument("--checkpoint-every", type=int,
                        help="tokens between checkpoints (default C of the scale; 0: only the "
                             "ends and branch points)")
    parser.add_argument("--profile", action="store_true",
                        help="a per-step breakdown of a hit and a miss (GPU-synchronised)")
    parser.add_argument("--groups", type=int, help="groups of prompts (fewer: a shorter run)")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args()


def kernels(model: torch.nn.Module, adapter: HybridCacheAdapter) -> str:
    """Which kernels the model's forward pass calls: read off the functions transformers
    chose when it imported the modeling code (it falls back to torch silently when a
    package is missing or fails to import)."""
    code = sys.modules[type(model).__module__]
    chosen = {}
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        function = getattr(code, name, None)
        found = inspect.getclosurevars(function).nonlocals.get("implementation") if function else None
        chosen[name] = getattr(found, "__module__", "") or ""
    fla = chosen["torch_chunk_gated_delta_rule"].startswith("fla")
    conv = chosen["causal_conv1d_fn"].startswith("causal_conv1d")
    capture = adapter.capture_for(model)
    return (f"gated delta rule: {'flash-linear-attention' if fla else 'torch fallback (no fla)'}; "
            f"causal conv1d: {'causal-conv1d' if conv else 'torch'}; attention: "
            f"{model.config._attn_implementation}; checkpoints: "
            f"{'one pass, kernels run in segments' if capture else 'one pass per checkpoint'}")


def run_model(args: argparse.Namespace, scale: Scale, size: ModelSize, device: torch.device) -> None:
    prompt_tokens = scale.system_tokens + scale.question_tokens
    longest = max(prompt_tokens, *scale.reload_tokens)
    log(f"scale {scale.name} on {device}: building {size.name} in {scale.dtype}")
    model = build(size, device, scale.dtype, longest + 1024)
    every_tokens = scale.checkpoint_tokens if args.checkpoint_every is None else args.checkpoint_every
    config = AdapterConfig(f"{size.name} seed 0", scale.page_tokens, longest,
                           every_tokens // scale.page_tokens or None, checkpoint_ends=False)
    vocab = model.config.vocab_size
    prompts = [(p.to(device), first) for p, first in workload(scale, vocab, args.seed)]
    # a group of the same shapes: its miss, its branch point and its hit, all untimed
    warmup = [(p.to(device), f) for p, f in workload(scale, vocab, args.seed + 1000, 1, False)][:3]
    probe = device_cache(model, config, 0)
    total = working_set(probe, scale, prompts + warmup)
    probe.close()
    budget = int(scale.gpu_cache_share * total)
    scale = dataclasses.replace(scale, host_budget=str(int(1.25 * total) + (1 << 30)))
    ideal = device_cache(model, config, total)
    log(f"working set {total / 2**30:.2f} GiB (the ideal holds it all); tiercache: device tier "
        f"{budget / 2**30:.2f} GiB, host tier {int(scale.host_budget) / 2**30:.2f} GiB")
    header = kernels(model, ideal)
    log(header)
    with tiercache(scale, model, config, budget if device.type == "cuda" else 0,
                   args.embedded) as (ours, client):
        systems = {"no cache": lambda p, f: no_cache(model, p, f),
                   "ideal": lambda p, f: cached(ideal, model, p, f),
                   "tiercache": lambda p, f: cached(ours, model, p, f)}
        if args.gpu_only:
            bounded = device_cache(model, config, budget)
            systems["GPU-only cache (B)"] = lambda p, f: cached(bounded, model, p, f)
        serve(systems, warmup)  # kernels, autotuning, allocators, registrations: not timed
        results = serve(systems, prompts)
        ours.flush()
        reloads = [reload_row(ours, client, model, n, scale.recompute_chunk, 3, 1)
                   for n in scale.reload_tokens]
        out = io.StringIO()
        with contextlib.redirect_stdout(Tee(sys.stdout, out)):
            report(args, scale, size, device, header, results, reloads, budget, total)
            if args.profile:
                profile({"ideal": ideal, "tiercache": ours}, model, scale, vocab, args.seed + 2000)
            tiers = {t.tier.name: t for t in client.stats().tiers}
            print("tiercache at the end: " + ", ".join(
                f"{n} {t.entries} entries, {t.used_bytes / 2**30:.2f} GiB" for n, t in tiers.items()))
            if device.type == "cuda":
                print(f"peak GPU memory allocated: "
                      f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
        ideal.close()
        if args.gpu_only:
            bounded.close()
    if os.environ.get("OUT"):
        name = size.name.split(",")[0].split()[0].lower()
        with open(os.path.join(os.environ["OUT"], f"shared_prefix-{name}.txt"), "w") as f:
            f.write(out.getvalue())


class Tee(io.TextIOBase):
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)


def report(args, scale: Scale, size: ModelSize, device: torch.device, header: str,
           results: dict, reloads: list, budget: int, total: int) -> None:
    figures = ttft_table(
        f"shared_prefix ({scale.name}: {scale.groups} x {scale.prompts} prompts, system "
        f"{scale.system_tokens} + question {scale.question_tokens} tokens, {size.name}, "
        f"{str(scale.dtype).removeprefix('torch.')}, {device.type}; {header})", results)
    print(f"GPU budget B = {budget / 2**30:.2f} GiB = {scale.gpu_cache_share:.0%} of the working "
          f"set ({total / 2**30:.2f} GiB) for tiercache's device tier (GPU only), beside its "
          f"host tier of {int(scale.host_budget) / 2**30:.2f} GiB; the ideal holds the working "
          "set on the GPU")
    print_table(f"reload vs recompute ({scale.name}: a stored prefix into a fresh cache, against "
                f"a warmed chunked prefill of {scale.recompute_chunk} tokens a pass)",
                ["prefix tokens", "recompute ms", "device tier ms", "host tier ms",
                 "speedup (host)", "MiB", "host GB/s", "bit-exact"], reloads)
    same = all(a.token == b.token for a, b in zip(results["tiercache"], results["ideal"]))
    speedup = reloads[1][4] if isinstance(reloads[1][4], float) else float("nan")
    ratios = targets(size.name, figures, same, speedup)
    summary(size.name.split(",")[0], ratios, figures)


def main() -> None:
    args = parse()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scale = SCALES[args.scale or ("full" if device.type == "cuda" else "cpu")]
    if args.groups is not None:
        scale = dataclasses.replace(scale, groups=args.groups)
    names = list(MODELS) if args.model == "both" else [args.model]
    for name in names:
        size = MODELS[name][0 if scale.gpu else 1]
        run_model(args, scale, size, device)
        gc.collect()  # the model and its caches go before the next model is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


if __name__ == "__main__":
    main()
