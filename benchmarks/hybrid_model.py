"""Random-weight hybrid models for the benchmarks, built from a config (no downloads), and
a clock that waits for the GPU.

`QWEN3_NEXT_8` is Qwen3-Next-80B-A3B layer for layer (hidden 2048; attention: 16 query
heads, 2 KV heads of 256; Gated DeltaNet: 16 key and 32 value heads of 128, conv kernel
4; MoE: 512 experts of 512, 10 routed + 1 shared; vocabulary 151,936), cut to 8 of its
48 layers with its 3:1 pattern (6 Gated DeltaNet + 2 full attention), in bf16: 27 GB of
weights, so prefill compute per token, KV bytes per token (4 KiB) and state bytes per
checkpoint (6 x 2.06 MiB, the recurrent state kept in fp32 as transformers' kernels
return it) are those of the real model divided by 6. `CPU_SMALL` has the same layer
pattern at widths a 2-core CPU runs in seconds.

`QWEN35_DENSE_8` is the dense Qwen3.5 layer shapes of transformers' `Qwen3_5TextConfig`
defaults (hidden 4096, MLP 12,288; attention: 16 query heads, 4 KV heads of 256; Gated
DeltaNet: 16 key and 32 value heads of 128; vocabulary 248,320), cut to 8 of its 32
layers (6 GDN + 2 attention): no MoE dispatch, so the fixed cost of a forward pass is that
of a dense model. `CPU_SMALL_DENSE` is its pattern at small widths.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import transformers


@dataclass(frozen=True)
class ModelSize:
    name: str
    layers: int
    overrides: dict = field(default_factory=dict)  # config fields; the rest default
    family: str = "Qwen3Next"  # Qwen3Next (MoE) or Qwen3_5 (dense)

    def config(self, max_tokens: int) -> transformers.PretrainedConfig:
        # The defaults of Qwen3NextConfig are Qwen3-Next-80B-A3B's shapes; those of
        # Qwen3_5TextConfig a dense Qwen3.5's.
        config_class = (transformers.Qwen3NextConfig if self.family == "Qwen3Next"
                        else transformers.Qwen3_5TextConfig)
        return config_class(num_hidden_layers=self.layers, max_position_embeddings=max_tokens,
                            **self.overrides)

    def model_class(self) -> type:
        return getattr(transformers, f"{self.family}ForCausalLM")


QWEN3_NEXT_8 = ModelSize("Qwen3-Next-80B-A3B shapes, 8 of 48 layers (6 GDN + 2 attention)", 8)
CPU_SMALL = ModelSize("Qwen3-Next pattern, small widths, 8 layers (6 GDN + 2 attention)", 8, dict(
    vocab_size=8192, hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
    linear_num_value_heads=8, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
    shared_expert_intermediate_size=256))
QWEN35_DENSE_8 = ModelSize("Qwen3.5 dense shapes, 8 of 32 layers (6 GDN + 2 attention)", 8,
                           family="Qwen3_5")
CPU_SMALL_DENSE = ModelSize("Qwen3.5 dense pattern, small widths, 8 layers (6 GDN + 2 attention)",
                            8, dict(vocab_size=8192, hidden_size=512, intermediate_size=1024,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    linear_key_head_dim=64, linear_value_head_dim=64,
                                    linear_num_key_heads=4, linear_num_value_heads=8),
                            family="Qwen3_5")
MODELS = {"qwen3-next": (QWEN3_NEXT_8, CPU_SMALL), "qwen3.5-dense": (QWEN35_DENSE_8, CPU_SMALL_DENSE)}


def build(size: ModelSize, device: torch.device, dtype: torch.dtype,
          max_tokens: int) -> torch.nn.Module:
    """The model with seeded random weights, made directly on `device` in `dtype`."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # weights are created in dtype: no fp32 copy on the way
    try:
        with torch.device(device):
            model = size.model_class()(size.config(max_tokens))
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def clock(device: torch.device) -> float:
    """Seconds, after the GPU has finished what was queued (CUDA work is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
