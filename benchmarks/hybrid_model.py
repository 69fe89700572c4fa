"""Random-weight Qwen3-Next-shaped models for the hybrid benchmarks, built from a config
(no downloads), and a clock that waits for the GPU.

`QWEN3_NEXT_8` is Qwen3-Next-80B-A3B layer for layer (hidden 2048; attention: 16 query
heads, 2 KV heads of 256; Gated DeltaNet: 16 key and 32 value heads of 128, conv kernel
4; MoE: 512 experts of 512, 10 routed + 1 shared; vocabulary 151,936), cut to 8 of its
48 layers with its 3:1 pattern (6 Gated DeltaNet + 2 full attention), in bf16: 27 GB of
weights, so prefill compute per token, KV bytes per token (4 KiB) and state bytes per
checkpoint (6 x 2.06 MiB, the recurrent state kept in fp32 as transformers' kernels
return it) are those of the real model divided by 6. `CPU_SMALL` has the same layer
pattern at widths a 2-core CPU runs in seconds.
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
    overrides: dict = field(default_factory=dict)  # Qwen3NextConfig fields; the rest default

    def config(self, max_tokens: int) -> transformers.Qwen3NextConfig:
        # The defaults of Qwen3NextConfig are Qwen3-Next-80B-A3B's shapes.
        return transformers.Qwen3NextConfig(num_hidden_layers=self.layers,
                                            max_position_embeddings=max_tokens, **self.overrides)


QWEN3_NEXT_8 = ModelSize("Qwen3-Next-80B-A3B shapes, 8 of 48 layers (6 GDN + 2 attention)", 8)
CPU_SMALL = ModelSize("Qwen3-Next pattern, small widths, 8 layers (6 GDN + 2 attention)", 8, dict(
    vocab_size=8192, hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
    linear_num_value_heads=8, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
    shared_expert_intermediate_size=256))


def build(size: ModelSize, device: torch.device, dtype: torch.dtype,
          max_tokens: int) -> torch.nn.Module:
    """The model with seeded random weights, made directly on `device` in `dtype`."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # weights are created in dtype: no fp32 copy on the way
    try:
        with torch.device(device):
            model = transformers.Qwen3NextForCausalLM(size.config(max_tokens))
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def clock(device: torch.device) -> float:
    """Seconds, after the GPU has finished what was queued (CUDA work is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
