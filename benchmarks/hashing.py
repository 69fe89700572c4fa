"""Page keys of long prompts, beside the per-page streaming reference of the seeds.

The reference is written the way LightLLM's DetachedMambaCheckpointCache builds its keys:
the tokens as a list, then per page a numpy array of those tokens as bytes fed into one
streaming xxh3_128 hasher with a digest after each page. Both get the prompt as the
Python list of token ids an inference server holds.
"""

from __future__ import annotations

import numpy as np
import xxhash

from benchmarks.common import median_seconds, print_summary, print_table
from tiercache.hashing import Namespace, page_keys


def reference_keys(tokens: list[int], page_tokens: int) -> list[bytes]:
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
        tokens = np.random.default_rng(prompt).integers(0, 151_000, prompt).tolist()
        for page in (16, 64):
            ours = median_seconds(lambda: page_keys(tokens, root, page), repeat=15)
            ref = median_seconds(lambda: reference_keys(tokens, page), repeat=5)
            speedups[(prompt, page)] = ref / ours
            rows.append((prompt, page, prompt // page, ours * 1e3, ref * 1e3, ref / ours))
    print_table("page keys of a prompt (list of token ids)",
                ["tokens", "page", "pages", "tiercache ms", "reference ms", "speedup"], rows)
    ms_128k = next(r[3] for r in rows if r[0] == 131072 and r[1] == 16)
    print_summary(speedup_vs_reference=min(speedups.values()),
                  speedup_128k_p16=speedups[(131072, 16)], ms_128k_p16=ms_128k)


if __name__ == "__main__":
    main()
