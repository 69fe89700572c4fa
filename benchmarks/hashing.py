"""Page keys of long prompts, beside the per-page streaming reference of the seeds.

The reference is written the way LightLLM's DetachedMambaCheckpointCache builds its keys:
the tokens as a list (`tolist()` of a tensor or array), then per page a numpy array of
those tokens as bytes fed into one streaming xxh3_128 hasher with a digest after each
page. Both get the same input, in two runs: the Python list of token ids a scheduler
holds, and the int64 tensor a model runner holds.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from benchmarks.common import median_seconds, print_summary, print_table
from tiercache.hashing import Namespace, page_keys


def reference_keys(tokens, page_tokens: int) -> list[bytes]:
    if not isinstance(tokens, list):
        tokens = tokens.tolist()
    hasher = xxhash.xxh3_128()
    keys = []
    for start in range(0, len(tokens) - page_tokens + 1, page_tokens):
        hasher.update(np.array(tokens[start:start + page_tokens], dtype=np.uint64).tobytes())
        keys.append(hasher.digest())
    return keys


def main() -> None:
    root = Namespace("bench-model", "bench-layout").root()
    rows, speedups = [], {}
    for prompt in (4096, 32768, 131072):
        ids = np.random.default_rng(prompt).integers(0, 151_000, prompt)
        for kind, tokens in (("list", ids.tolist()), ("tensor", torch.from_numpy(ids))):
            for page in (16, 64):
                ours = median_seconds(lambda: page_keys(tokens, root, page), repeat=15)
                ref = median_seconds(lambda: reference_keys(tokens, page), repeat=5)
                speedups[(kind, prompt, page)] = ref / ours
                rows.append((kind, prompt, page, prompt // page, ours * 1e3, ref * 1e3, ref / ours))
    print_table("page keys of a prompt",
                ["input", "tokens", "page", "pages", "tiercache ms", "reference ms", "speedup"], rows)
    ms = {kind: next(r[4] for r in rows if r[:3] == (kind, 131072, 16)) for kind in ("list", "tensor")}
    print_summary(speedup_vs_reference=min(v for k, v in speedups.items() if k[0] == "list"),
                  speedup_vs_reference_tensor=min(v for k, v in speedups.items() if k[0] == "tensor"),
                  ms_128k_p16=ms["list"], ms_128k_p16_tensor=ms["tensor"])


if __name__ == "__main__":
    main()
