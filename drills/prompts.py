"""The prompt universe of the crash, soak and fuzz drills: small hybrid entries, prompts
of five pages whose first two pages are shared by a family of prompts."""

from __future__ import annotations

import numpy as np

from tiercache.layout import BufferSpec, Layout

MODEL = "reliability-model"
PAGE = 16
PAGES = 5  # per prompt
SHARED = 2  # leading pages shared by the prompts of one family
FAMILIES = 8
LAYOUT = Layout(PAGE, paged=tuple(BufferSpec(f"kv{i}", 4 * PAGES, (PAGE, 2, 8), "bfloat16")
                                  for i in range(2)),
                slots=(BufferSpec("ssm", 4, (8, 8), "float32"),))


def tokens(prompt: int) -> list[int]:
    """Prompt `prompt`'s tokens: its family's shared pages, then pages of its own."""
    shared = np.random.default_rng(prompt % FAMILIES).integers(0, 150_000, SHARED * PAGE)
    own = np.random.default_rng(1_000_000 + prompt).integers(0, 150_000, (PAGES - SHARED) * PAGE)
    return np.concatenate([shared, own]).tolist()
