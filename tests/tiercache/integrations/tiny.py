"""Tiny random hybrid models and the references a loaded prefix is held to, shared by the
adapter tests and the worker processes they start (float32, CPU, no downloads)."""

from __future__ import annotations

import torch
import transformers

PAGE = 8
VOCAB = 128


def tiny_qwen3_next() -> torch.nn.Module:
    """Three Gated DeltaNet layers and one full-attention layer, as in the real model. Seeded:
    every process that builds it gets the same weights."""
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
    return transformers.Qwen3NextForCausalLM(config).eval()


def tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, count), generator=torch.Generator().manual_seed(seed))


def in_memory(model, input_ids: torch.Tensor, chunks: list[int], keep: int = 1) -> torch.Tensor:
    """Logits of the last `keep` of `chunks` forward passes over one cache that never left
    memory, concatenated."""
    cache = transformers.DynamicCache(config=model.config)
    done, logits = 0, []
    with torch.no_grad():
        for count in chunks:
            out = model(input_ids=input_ids[:, done:done + count], past_key_values=cache,
                        use_cache=True)
            done += count
            logits.append(out.logits)
    assert done == input_ids.shape[1]
    return torch.cat(logits[-keep:], dim=1)


def full_prefill(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def greedy(model, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
    """Five greedy tokens after `input_ids`, from `cache` (which has seen a prefix of them)."""
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, past_key_values=cache, max_new_tokens=5,
                             do_sample=False)
    return out[0, input_ids.shape[1]:]


def decode(model, cache, logits: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """`steps` greedy tokens continuing `cache`, whose last logits are `logits` [1, n, vocab]."""
    out = [logits[0, -1].argmax()]
    with torch.no_grad():
        for _ in range(steps - 1):
            step = model(input_ids=out[-1].view(1, 1), past_key_values=cache, use_cache=True)
            out.append(step.logits[0, -1].argmax())
    return torch.stack(out)


def captured(model, input_ids: torch.Tensor, at: int) -> transformers.DynamicCache:
    """A cache that has seen input_ids[:, :at], made in memory from ONE forward pass over all
    of input_ids: the KV cut at `at`, the states `Capture` kept there. The same checkpoint a
    prefill stores, never copied through tiercache."""
    from tiercache.integrations.capture import Capture
    from tiercache.integrations.hf_cache import CacheSpec
    spec = CacheSpec.probe(model, lambda: transformers.DynamicCache(config=model.config))
    capture = Capture.of(model, sorted({s.layer for s in spec.states}))
    kept: dict = {}
    whole = transformers.DynamicCache(config=model.config)
    with torch.no_grad(), capture.during(whole, input_ids.shape[1], [at],
                                         lambda cut, layer, kind, s: kept.update({(layer, kind): s.clone()})):
        model(input_ids=input_ids, past_key_values=whole, use_cache=True)
    cache = transformers.DynamicCache(config=model.config)
    for kv in spec.kv:
        layer = whole.layers[kv.layer]
        cache.update(layer.keys[:, :, :at], layer.values[:, :, :at], kv.layer)
    for s in spec.states:
        update = cache.update_conv_state if s.kind == "conv" else cache.update_recurrent_state
        update(kept[s.layer, s.kind], s.layer)
        cache.layers[s.layer].has_previous_state[s.index] = True
    return cache


def continued(model, cache, input_ids: torch.Tensor, cuts: tuple[int, ...] = ()) -> torch.Tensor:
    """Logits of one forward pass over `input_ids` continuing `cache`; with `cuts`, its
    linear-attention kernels run in segments split there, as a prefill that keeps the
    states at those offsets computes them (the segments' sums round their own way)."""
    from contextlib import nullcontext
    from tiercache.integrations.capture import Capture
    from tiercache.integrations.hf_cache import CacheSpec
    scope = nullcontext()
    if cuts:
        spec = CacheSpec.probe(model, lambda: transformers.DynamicCache(config=model.config))
        capture = Capture.of(model, sorted({s.layer for s in spec.states}))
        scope = capture.during(cache, input_ids.shape[1], list(cuts), lambda *_: None)
    with torch.no_grad(), scope:
        return model(input_ids=input_ids, past_key_values=cache, use_cache=True).logits
