"""Checkpoints from one forward pass: the linear-attention states at chosen token offsets.

A chunked linear-attention kernel computes the state at every boundary inside a prefill
anyway; splitting the whole model into passes to stop there costs a pass's fixed price
(every layer, MoE dispatch, a sweep over the weights) per checkpoint. Instead, while a
`Capture` is active, each linear-attention layer of the one pass

- runs its chunked kernel in segments, in order, each starting from the state the last
  one ended with (`initial_state` and `output_final_state` of the kernel's public API), and
  keeps the recurrent state at each boundary;
- has its conv state at each boundary cut out of the conv input the layer hands its
  cache (`Cache.update_conv_state`): the last `conv_kernel_size` inputs before it, exactly
  what a pass ending there would have cached.

Everything else in the pass (attention, MLP, MoE) runs once over the whole prompt. A
segmented kernel is the same computation as a pass that ended at the boundary, so the
states equal those of a chunked prefill up to the rounding of the projections computed
over more rows at once (a GEMM's sums depend on its shape), and so do the logits.

The kernels are found by the names transformers' modeling code calls them under
(`KERNELS`): the gated delta rule of Qwen3-Next and Qwen3.5, whichever implementation is
behind it (flash-linear-attention's Triton kernel on a GPU, transformers' torch fallback
otherwise), and `mamba2_chunk_scan` of the Mamba-2 families (Nemotron-H, Falcon-H1,
Bamba: mamba_ssm's kernel or the torch fallback). A model whose linear-attention layers
call none of them gets no `Capture` (`Capture.of` returns None) and the adapter falls back
to passes that end at each checkpoint. Activating a capture swaps module globals of the
modeling code for the duration of one pass: one capture at a time per process.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Kernel:
    """How to run a chunked linear-attention kernel in segments."""

    sequence: tuple[str, ...]  # arguments with the tokens on dim 1 ([batch, tokens, ...])
    initial: str  # the argument that takes the state to start from
    final: str  # the flag that makes the kernel return its final state


KERNELS = {
    "torch_chunk_gated_delta_rule": Kernel(("query", "key", "value", "g", "beta"),
                                           "initial_state", "output_final_state"),
    "mamba2_chunk_scan": Kernel(("hidden_states", "dt", "B", "C", "z"),
                                "initial_states", "return_final_states"),
}

# (cut, layer, "conv" or "recurrent", state with its batch dimension)
Keep = Callable[[int, int, str, torch.Tensor], None]


class CaptureFailed(RuntimeError):
    """A layer did not go through the kernels the capture expected: use chunked passes."""


class Capture:
    """Captures the states of a model's linear-attention layers at token offsets of one pass."""

    def __init__(self, modules: dict[str, ModuleType], layers: frozenset[int]) -> None:
        self.modules = modules  # kernel name -> the modeling module that calls it
        self.layers = layers  # linear-attention layer indices

    @classmethod
    def of(cls, model: torch.nn.Module, layers: Sequence[int]) -> "Capture | None":
        """A capture for `model` if every one of its linear-attention `layers` is computed by
        a kernel of `KERNELS` (found in the modeling module of its mixer), else None."""
        modules: dict[str, ModuleType] = {}
        covered: set[int] = set()
        for module in model.modules():
            index = getattr(module, "layer_idx", None)
            if index not in layers:
                continue
            code = sys.modules.get(type(module).__module__)
            names = [name for name in KERNELS if callable(getattr(code, name, None))
                     and name in _called_names(type(module))]
            if names:
                modules[names[0]] = code
                covered.add(index)
        return cls(modules, frozenset(layers)) if covered == set(layers) and modules else None

    @contextmanager
    def during(self, cache: object, tokens: int, cuts: Sequence[int], keep: Keep) -> Iterator[None]:
        """While active, a forward pass of `tokens` tokens with `cache` hands `keep` the conv
        and recurrent states of every linear-attention layer after each of `cuts` tokens of
        the pass (0 < cut < tokens; the state at the end stays in the cache as usual)."""
        cuts = sorted(set(cuts))
        if not cuts:
            yield
            return
        if cuts[0] <= 0 or cuts[-1] >= tokens:
            raise ValueError(f"cuts must lie inside the pass of {tokens} tokens, got {cuts}")
        pending: list[list[torch.Tensor]] = []
        seen: set[tuple[int, str]] = set()
        originals = {name: getattr(code, name) for name, code in self.modules.items()}

        def recurrent(states: torch.Tensor, layer_idx: int, *args, **kwargs):
            if layer_idx in self.layers:
                if not pending:
                    raise CaptureFailed(f"layer {layer_idx} stored a state its kernel did not "
                                        "run in segments")
                for cut, state in zip(cuts, pending.pop()):
                    keep(cut, layer_idx, "recurrent", state)
                seen.add((layer_idx, "recurrent"))
            return type(cache).update_recurrent_state(cache, states, layer_idx, *args, **kwargs)

        def conv(inputs: torch.Tensor, layer_idx: int, *args, **kwargs):
            if layer_idx in self.layers:
                for cut, state in zip(cuts, _conv_windows(cache, inputs, layer_idx, cuts, kwargs)):
                    keep(cut, layer_idx, "conv", state)
                seen.add((layer_idx, "conv"))
            return type(cache).update_conv_state(cache, inputs, layer_idx, *args, **kwargs)

        cache.update_recurrent_state, cache.update_conv_state = recurrent, conv
        for name, code in self.modules.items():
            setattr(code, name, _segmented(originals[name], KERNELS[name], tokens, cuts, pending))
        try:
            yield
        finally:
            for name, code in self.modules.items():
                setattr(code, name, originals[name])
            del cache.update_recurrent_state, cache.update_conv_state
        missing = sorted(self.layers - {layer for layer, kind in seen if kind == "recurrent"})
        if missing or pending:
            raise CaptureFailed(f"linear-attention layers {missing} were not captured")


def _called_names(cls: type) -> set[str]:
    """Global names the forward methods of `cls` refer to."""
    names: set[str] = set()
    for klass in cls.__mro__:
        for attr in ("forward", "torch_forward", "cuda_kernels_forward"):
            function = klass.__dict__.get(attr)
            code = getattr(inspect.unwrap(function), "__code__", None) if function else None
            if code is not None:
                names.update(code.co_names)
    return names


def _segmented(kernel: Callable, spec: Kernel, tokens: int, cuts: list[int],
               pending: list[list[torch.Tensor]]) -> Callable:
    """`kernel` run over [0, cut_1), [cut_1, cut_2), ... [cut_n, tokens), each segment
    starting from the state the previous one returned; the states at the cuts go to
    `pending` (one list per call), the outputs are concatenated. Arguments keep the form
    the model passed them in (positional or by name): the implementation behind the name
    (fla, mamba_ssm) may order its parameters differently from transformers' fallback."""
    names = list(inspect.signature(kernel).parameters)

    def run(*args, **kwargs):
        positional = names[:len(args)]
        given = dict(zip(positional, args)) | kwargs
        if given[spec.sequence[0]].shape[1] != tokens:
            raise CaptureFailed(f"a kernel call over {given[spec.sequence[0]].shape[1]} tokens "
                                f"in a pass of {tokens}")
        outputs, states, state = [], [], given.get(spec.initial)
        for start, end in zip([0, *cuts], [*cuts, tokens]):
            part = {name: value[:, start:end] if name in spec.sequence and value is not None
                    else value for name, value in given.items()}
            part[spec.initial], part[spec.final] = state, True
            ordered = [part.pop(name) for name in positional]
            output, state = kernel(*ordered, **part)
            outputs.append(output)
            if end < tokens:
                states.append(state)
        pending.insert(0, states)
        return torch.cat(outputs, dim=1), state

    return run


def _conv_windows(cache: object, inputs: torch.Tensor, layer_idx: int, cuts: list[int],
                  kwargs: dict) -> list[torch.Tensor]:
    """The conv state after each cut: the last `width` conv inputs before it, the cached
    ones in front of this pass's, zeros before the first token. Views: `keep` copies them."""
    layer = cache.layers[layer_idx]
    index = kwargs.get("state_idx", 0)
    width = kwargs.get("conv_kernel_size") or layer.conv_kernel_size[index]
    if not width:
        raise CaptureFailed(f"layer {layer_idx} gave no conv kernel size")
    offset = 0
    if layer.has_previous_state[index]:
        offset = layer.conv_states[index].shape[-1]
        inputs = torch.cat([layer.conv_states[index], inputs], dim=-1)
    windows = []
    for cut in cuts:
        window = inputs[..., max(0, offset + cut - width):offset + cut]
        windows.append(F.pad(window, (width - window.shape[-1], 0))
                       if window.shape[-1] < width else window)
    return windows
