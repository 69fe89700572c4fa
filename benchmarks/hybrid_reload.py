"""Reloading a stored prefix into a fresh transformers cache through tiercache, against
recomputing it: the second table of benchmarks.shared_prefix.

A random prefix of N tokens is prefilled in chunks (the recompute time: the median of
runs after one that warms the kernels up), stored through
the adapter, then loaded back into fresh caches: match, copy into the staging rows,
rebuild the transformers cache. On a GPU the store lands in the daemon's device tier, so
the first loads read it there (device to device); once the daemon has copied it down to
the host, it is evicted from the device and loaded again from the host tier (host to
device over PCIe), which is what the speedup is taken from. Every loaded cache is checked
bit for bit against the computed one.
"""

from __future__ import annotations

import statistics
import sys

import torch

from benchmarks.hybrid_model import clock
from tiercache.results import Tier
from tiercache.integrations.transformers import (
    CacheSpec, DynamicCache, HybridCacheAdapter, Restored)


def recompute(model: torch.nn.Module, prefix: torch.Tensor, chunk: int) -> tuple[float, object]:
    cache = DynamicCache(config=model.config)
    start = clock(prefix.device)
    with torch.no_grad():
        for at in range(0, prefix.shape[1], chunk):
            model(input_ids=prefix[:, at:at + chunk], past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
    return clock(prefix.device) - start, cache


def same_cache(spec: CacheSpec, a, b) -> bool:
    kv = all(torch.equal(getattr(a.layers[s.layer], part), getattr(b.layers[s.layer], part))
             for s in spec.kv for part in ("keys", "values"))
    return kv and all(torch.equal(getattr(a.layers[s.layer], f"{s.kind}_states")[s.index],
                                  getattr(b.layers[s.layer], f"{s.kind}_states")[s.index])
                      for s in spec.states)


def timed_loads(adapter: HybridCacheAdapter, prefix: torch.Tensor,
                repeats: int) -> tuple[float, Restored]:
    times, restored = [], None
    for _ in range(repeats):
        del restored  # the previous copy goes before the next arrives
        start = clock(prefix.device)
        restored = adapter.load(prefix[0])
        times.append(clock(prefix.device) - start)
    return statistics.median(times), restored


def reload_row(adapter: HybridCacheAdapter, client, model: torch.nn.Module, tokens: int,
               chunk: int, repeats: int, prefills: int) -> list:
    """[tokens, recompute ms, device reload ms (GPU), host reload ms, speedup over the host
    reload, MiB, host reload GB/s, bit-exact]."""
    gen = torch.Generator().manual_seed(tokens)
    prefix = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen).to(adapter.device)
    times, cache = [], None
    for _ in range(prefills + 1):  # the first warms the kernels up for these shapes: untimed
        del cache  # the previous cache goes before the next is built
        seconds, cache = recompute(model, prefix, chunk)
        times.append(seconds)
    prefill = statistics.median(times[1:])
    adapter.store(prefix[0], cache)
    on_gpu = prefix.device.type == "cuda"
    device, exact = "", True
    timed_loads(adapter, prefix, 1)  # warms the load path up: untimed
    if on_gpu:
        seconds, restored = timed_loads(adapter, prefix, repeats)
        device = f"{1e3 * seconds:.3g} ({'+'.join(t.name.lower() for t in restored.load.bytes_from)})"
        exact, restored = same_cache(adapter.spec, restored.cache, cache), None
        # the daemon copies entries down to the host before it drops their device copies
        adapter.worker.evict(keys=adapter.keys(prefix[0]), tier=Tier.DEVICE)
    host, restored = timed_loads(adapter, prefix, repeats)
    if restored.tokens != tokens or set(restored.load.bytes_from) != {Tier.HOST}:
        raise RuntimeError(f"the {tokens}-token prefix did not come back whole from the host "
                           f"tier: {restored.tokens} tokens from {restored.load.bytes_from}")
    exact = exact and same_cache(adapter.spec, restored.cache, cache)
    nbytes = sum(restored.load.bytes_from.values())
    print(f"[shared_prefix] reload {tokens} tokens: host {1e3 * host:.1f} ms, device {device} ms, "
          f"recompute {1e3 * prefill:.0f} ms", file=sys.stderr, flush=True)
    return [tokens, 1e3 * prefill, device, 1e3 * host, prefill / host, nbytes / 2**20,
            nbytes / host / 1e9, "yes" if exact else "NO"]
