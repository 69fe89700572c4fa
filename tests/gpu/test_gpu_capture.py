"""Checkpoints from one forward pass on a GPU, with the kernels a deployment runs
(flash-linear-attention's gated delta rule where it is installed: make wheels carries it).
Runs only where there is a GPU (make test-gpu); the CPU suite runs the same properties on
transformers' torch fallback (tests/tiercache/integrations/test_capture.py)."""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiercache.engine import Engine, EngineConfig  # noqa: E402
from tiercache.integrations.capture import Capture  # noqa: E402
from tiercache.integrations.transformers import (  # noqa: E402
    AdapterConfig, CacheSpec, HybridCacheAdapter)
from tiercache.tiers.host import HostConfig  # noqa: E402
from tests.tiercache.integrations.tiny import captured, continued  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
PAGE = 64  # fla's chunk: boundaries inside and between its chunks are both covered below


def model_on_gpu() -> torch.nn.Module:
    """A small Qwen3-Next at widths the Triton kernels take (head dims of 64), in bf16."""
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=4096)
    return transformers.Qwen3NextForCausalLM(config).to("cuda", torch.bfloat16).eval()


def ids(count: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (1, count), generator=gen).cuda()


@pytest.mark.parametrize("cut", [PAGE, 3 * PAGE + 16])
def test_states_kept_inside_one_pass_match_a_pass_stopping_there(cut):
    model = model_on_gpu()
    spec = CacheSpec.probe(model, lambda: transformers.DynamicCache(config=model.config))
    layers = sorted({s.layer for s in spec.states})
    capture = Capture.of(model, layers)
    prompt = ids(5 * PAGE + 7, seed=1)
    kept: dict = {}
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad(), capture.during(cache, prompt.shape[1], [cut], lambda c, layer, kind, s:
                                         kept.update({(layer, kind): s.clone()})):
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    stopped = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt[:, :cut], past_key_values=stopped, use_cache=True)
    for (layer, kind), state in kept.items():
        reference = getattr(stopped.layers[layer], f"{kind}_states")[0]
        torch.testing.assert_close(state.float(), reference.float(), atol=5e-2, rtol=5e-2)


def test_a_prefix_restored_on_the_gpu_continues_bit_exactly():
    model = model_on_gpu()
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=256 << 20)))
    config = AdapterConfig("gpu-capture", page_tokens=PAGE, max_tokens=1024)
    first = ids(4 * PAGE + 9, seed=2)
    with HybridCacheAdapter.for_model(model, engine, config) as adapter:
        run = adapter.prefill(model, first)
        assert (run.chunks, run.checkpoints) == ((first.shape[1],), (4,))
        run.store.result()
        second = torch.cat([first[:, :4 * PAGE + 3], ids(50, seed=3)], dim=1)
        restored = adapter.load(second[0, :-1])
        assert restored.tokens == 4 * PAGE
        ours = continued(model, restored.cache, second[:, 4 * PAGE:])
    kept = continued(model, captured(model, first, 4 * PAGE), second[:, 4 * PAGE:])
    assert torch.equal(ours, kept)
    engine.close()
