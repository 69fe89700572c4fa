"""Checkpoints from one forward pass (`integrations.capture`) on tiny random models of every
hybrid family transformers builds from its linear-attention cache layers (float32, CPU).

The states kept at a boundary inside one pass are those a pass stopping there reaches,
within rounding; a prefix stored from them and loaded by a fresh adapter continues
bit-identically to the same states kept in memory. Families whose kernels cannot be run
in segments (short-conv layers) fall back to one pass per checkpoint, with a log line.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.23")

from tiercache.engine import Engine, EngineConfig  # noqa: E402
from tiercache.integrations.capture import Capture  # noqa: E402
from tiercache.integrations.transformers import (  # noqa: E402
    AdapterConfig, CacheSpec, HybridCacheAdapter)
from tiercache.tiers.host import HostConfig  # noqa: E402
from tests.tiercache.integrations.tiny import (  # noqa: E402
    PAGE, VOCAB, captured, continued, full_prefill, in_memory, tiny_qwen3_next, tokens)

MiB = 1 << 20
# GDN like Qwen3-Next; attention and Mamba-2 in one layer; Mamba-2 with MLP-only (dummy)
# layers; short-conv layers with a conv state and no recurrent state (no kernel to segment).
FAMILIES = {
    "Qwen3_5": dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4),
    "FalconH1": dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, mamba_d_ssm=32,
        mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8),
    "NemotronH": dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, mamba_num_heads=4,
        mamba_head_dim=8, ssm_state_size=8, n_groups=1, chunk_size=8,
        layers_block_type=["mamba", "attention", "mlp", "mamba"]),
    "Lfm2": dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, full_attn_idxs=[1, 3]),
}
CONFIG_CLASSES = {"Qwen3_5": "Qwen3_5TextConfig"}
SEGMENTED = {"Qwen3Next", "Qwen3_5", "FalconH1", "NemotronH"}


def build(family: str) -> torch.nn.Module:
    if family == "Qwen3Next":
        return tiny_qwen3_next()
    config_class = getattr(transformers, CONFIG_CLASSES.get(family, f"{family}Config"))
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config_class(**FAMILIES[family])).eval()


def state_layers(model) -> list[int]:
    spec = CacheSpec.probe(model, lambda: transformers.DynamicCache(config=model.config))
    return sorted({s.layer for s in spec.states})


@pytest.mark.parametrize("family", sorted(SEGMENTED))
def test_states_kept_inside_one_pass_are_those_a_pass_stopping_there_reaches(family):
    model = build(family)
    capture = Capture.of(model, state_layers(model))
    prompt = tokens(45, seed=30)
    kept: dict = {}
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad(), capture.during(cache, 45, [16, 40], lambda cut, layer, kind, s:
                                         kept.update({(cut, layer, kind): s.clone()})):
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits
    # every state of every linear-attention layer, at both cuts
    assert {(layer, kind) for _, layer, kind in kept} == {
        (layer, kind) for layer in state_layers(model) for kind in ("conv", "recurrent")}
    for cut in (16, 40):
        stopped = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt[:, :cut], past_key_values=stopped, use_cache=True)
        for (at, layer, kind), state in kept.items():
            if at == cut:
                reference = getattr(stopped.layers[layer], f"{kind}_states")[0]
                torch.testing.assert_close(state, reference, atol=1e-5, rtol=1e-5)
    # the pass itself is a plain prefill, within rounding
    torch.testing.assert_close(logits, full_prefill(model, prompt), atol=1e-4, rtol=0)


def test_a_capture_leaves_the_model_and_the_cache_as_they_were():
    model = tiny_qwen3_next()
    capture = Capture.of(model, state_layers(model))
    (name, code), = capture.modules.items()
    original = getattr(code, name)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad(), capture.during(cache, 20, [8], lambda *_: None):
        assert getattr(code, name) is not original  # swapped for the one pass
        model(input_ids=tokens(20, seed=31), past_key_values=cache, use_cache=True)
    assert getattr(code, name) is original
    assert "update_conv_state" not in vars(cache) and "update_recurrent_state" not in vars(cache)
    with pytest.raises(ValueError, match="inside the pass"):
        with capture.during(cache, 20, [20], lambda *_: None):
            pass


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_round_trip_bit_exactly(family, caplog):
    model = build(family)
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    config = AdapterConfig(model_id=f"tiny-{family}", page_tokens=PAGE, max_tokens=64)
    with caplog.at_level(logging.WARNING, logger="tiercache.integrations"):
        adapter = HybridCacheAdapter.for_model(model, engine, config)
        assert adapter.layout.needs_pages and adapter.layout.needs_checkpoint
        first = tokens(29, seed=10)
        run = adapter.prefill(model, first)  # keeps the state after page 3 (token 24)
    segmented = family in SEGMENTED
    assert run.chunks == ((29,) if segmented else (24, 5))
    assert ("cannot be run in segments" in caplog.text) is not segmented
    adapter.close()

    # A fresh adapter resumes after page 3, bit for bit as the state kept in memory.
    second = torch.cat([first[:, :26], tokens(6, seed=11)], dim=1)
    fresh = HybridCacheAdapter.for_model(model, engine, config)
    run = fresh.prefill(model, second)
    assert (run.loaded_tokens, run.chunks) == (24, (8,))
    kept = (continued(model, captured(model, first, 24), second[:, 24:]) if segmented
            else in_memory(model, second, [24, 8]))
    assert torch.equal(run.logits, kept)
    fresh.close()
    engine.close()


def test_segments_keep_the_form_the_model_passed_each_argument_in():
    # transformers' name for a kernel has its fallback's signature but calls whatever
    # implementation it found with the arguments as given: mamba_ssm's puts `z` where the
    # fallback has `dt_bias`. Arguments the model passes by name must stay by name. The
    # "state" here is the running sum over tokens of hidden_states * dt + dt_bias.
    import functools
    from tiercache.integrations.capture import KERNELS, _segmented

    def implementation(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                       initial_states=None, return_final_states=False):
        assert z is None, "dt_bias went into z"
        start = 0 if initial_states is None else initial_states
        running = start + torch.cumsum(x * dt + dt_bias, dim=1)
        return running, running[:, -1]

    def fallback(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None,
                 initial_states=None, dt_softplus=False, return_final_states=False, **kwargs):
        raise AssertionError("not the one that runs")

    @functools.wraps(fallback)
    def named(*args, **kwargs):  # what transformers' decorator builds
        return implementation(*args, **kwargs)

    x, dt = torch.arange(1.0, 11.0).view(1, 10), torch.full((1, 10), 2.0)
    pending: list = []
    run = _segmented(named, KERNELS["mamba2_chunk_scan"], 10, [3, 7], pending)
    out, final = run(x, dt, None, x, x, chunk_size=4, D=None, z=None, dt_bias=1.0,
                     return_final_states=True)
    whole, last = implementation(x, dt, None, x, x, 4, dt_bias=1.0)
    assert torch.equal(out, whole) and torch.equal(final, last)
    assert [float(s) for s in pending[0]] == [2 * 6 + 3, 2 * 28 + 7]
