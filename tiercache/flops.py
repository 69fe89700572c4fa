"""Prefill FLOPs of a hybrid model, from its shape: what a cached prefix saves.

Counts the matrix products of one forward pass over a prompt, 2 FLOPs per multiply-add.
Norms, convolutions, gates, rotary embeddings and the LM head are left out (a few per
cent). Every layer costs the same per token except attention, whose score and value
products grow with the token's position, so the prefill of the first T tokens costs

    F(T) = T * token_flops + attention_flops * T (T + 1) / 2

and page i (1-based, P tokens) costs F(iP) - F((i-1)P): later pages cost more.
Mixture-of-experts layers count the experts a token is routed to (give the summed
intermediate size of the active and shared experts).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from tiercache.errors import InvalidArgument


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide a model's prefill cost; ints and a name only, so that a
    registration message can carry it."""

    name: str
    hidden_size: int
    attention_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    mlp_layers: int = 0
    intermediate_size: int = 0  # per token: active + shared experts for a mixture of experts
    mlp_matrices: int = 3  # 3 for a gated MLP (SwiGLU), 2 for a plain one
    ssm_layers: int = 0  # Mamba-2, gated delta net, ...: layers with a recurrent state
    ssm_heads: int = 0
    ssm_head_dim: int = 0  # value dimension per head: inner size = heads * head dim
    ssm_state_size: int = 0  # state (key) dimension per head
    ssm_groups: int = 1  # heads sharing one B/C (Mamba-2 groups, GDN key heads)

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgument("model.name is empty: name the model the shape describes")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and (not isinstance(value, int) or value < 0):
                raise InvalidArgument(f"model.{f.name} must be a non-negative integer, got {value!r}")
        if self.hidden_size <= 0 or not (self.attention_layers or self.mlp_layers or self.ssm_layers):
            raise InvalidArgument("a model shape needs hidden_size > 0 and at least one layer")
        self._need("attention_layers", "num_heads", "num_kv_heads", "head_dim")
        self._need("mlp_layers", "intermediate_size", "mlp_matrices")
        self._need("ssm_layers", "ssm_heads", "ssm_head_dim", "ssm_state_size", "ssm_groups")
        if self.attention_layers and self.num_heads % self.num_kv_heads:
            raise InvalidArgument(f"model.num_heads {self.num_heads} is not a multiple of "
                                  f"num_kv_heads {self.num_kv_heads}")

    def _need(self, layers: str, *dims: str) -> None:
        zero = [d for d in dims if getattr(self, layers) and not getattr(self, d)]
        if zero:
            raise InvalidArgument(f"model.{layers} is {getattr(self, layers)} but {zero[0]} is 0: "
                                  "give the dimensions of every kind of layer the model has")

    @property
    def token_flops(self) -> int:
        """FLOPs of one token that do not depend on its position."""
        h = self.hidden_size
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = 2 * h * (2 * q_width + 2 * kv_width)  # Q, K, V in; O out
        mlp = 2 * self.mlp_matrices * h * self.intermediate_size
        inner = self.ssm_heads * self.ssm_head_dim
        ssm_in = 2 * inner + 2 * self.ssm_groups * self.ssm_state_size + self.ssm_heads  # z, x, B, C, dt
        # projections in and out, and the recurrence: decay and update the state, read it
        ssm = 2 * h * (ssm_in + inner) + 6 * inner * self.ssm_state_size
        return self.attention_layers * attention + self.mlp_layers * mlp + self.ssm_layers * ssm

    @property
    def attention_flops(self) -> int:
        """FLOPs per token and per earlier token it attends to: Q·K and the weighted V."""
        return self.attention_layers * 4 * self.num_heads * self.head_dim


def prefix_flops(model: ModelShape, tokens: np.ndarray | int) -> np.ndarray:
    """F(T): FLOPs of the prefill of the first T tokens (float64, any shape of T)."""
    t = np.asarray(tokens, np.float64)
    return t * model.token_flops + model.attention_flops * t * (t + 1) / 2


def page_flops(model: ModelShape, page_tokens: int, pages: np.ndarray | int) -> np.ndarray:
    """FLOPs of the prefill of page i alone (1-based), after the i - 1 pages before it."""
    i = np.asarray(pages, np.float64)
    return prefix_flops(model, i * page_tokens) - prefix_flops(model, (i - 1) * page_tokens)


def saved_flops(model: ModelShape | None, page_tokens: int, pages: np.ndarray | int,
                tp_size: int = 1) -> np.ndarray:
    """What a hit of `pages` pages saves one tensor-parallel rank: F(pages * page_tokens) /
    tp_size. Without a model shape, the prompt's token count stands in for its FLOPs (a
    model whose cost is linear in length), so longer hits still count for more."""
    tokens = np.asarray(pages, np.float64) * page_tokens
    if model is None:
        return tokens
    return prefix_flops(model, tokens) / tp_size
