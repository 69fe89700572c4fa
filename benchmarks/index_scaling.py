"""Match cost and memory of the index as it grows from 1k to 1M pages.

The same 32k-token prompt (2048 pages of 16 tokens) is matched against an index that
holds its first 1000 pages (with a checkpoint every 100 pages) and nothing else, and
against one that also holds 999,000 pages of other prompts. The match walks the same
1000 pages in both; only the index size differs. Memory is what tracemalloc sees the
index allocate per page, keys included.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np

from benchmarks.common import median_seconds, print_summary, print_table
from tiercache.engine import Engine, EngineConfig
from tiercache.hashing import Namespace, key_array, page_keys
from tiercache.index import Index
from tiercache.results import Kind, Tier
from tiercache.layout import BufferSpec, Layout
from tiercache.tiers.host import HostConfig, host_arena

LAYOUT = Layout(16, paged=(BufferSpec("kv", 8, (16, 1024), "bfloat16"),),
                slots=(BufferSpec("state", 8, (1024,), "float32"),))
ROOT = Namespace("bench", LAYOUT.fingerprint).root()


def random_keys(seed: int, pages: int) -> np.ndarray:
    tokens = np.random.default_rng(seed).integers(0, 150_000, pages * 16)
    return key_array(page_keys(tokens, ROOT, 16))


def build(prompt: np.ndarray, others: int) -> Index:
    index = Index()
    depths = range(1, 1001)
    index.publish(Kind.PAGE, prompt[:1000], depths, LAYOUT.page_bytes, Tier.DISK)
    index.publish(Kind.CHECKPOINT, prompt[99:1000:100], depths[99::100], LAYOUT.checkpoint_bytes, Tier.DISK)
    for seed in range(others // 1000):  # other prompts of 1000 pages each
        index.publish(Kind.PAGE, random_keys(seed + 1, 1000), depths, LAYOUT.page_bytes, Tier.DISK)
    return index


def bytes_per_page(prompt: np.ndarray, others: int) -> float:
    gc.collect()
    tracemalloc.start()
    index = build(prompt, others)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return used / (len(index) - 10)  # the ten checkpoints are not pages


def match_seconds(index: Index, prompt: np.ndarray) -> float:
    """Median time of Engine.match given the prompt's keys packed as bytes, as they come
    off the wire (the worker hashed them)."""
    engine = Engine(EngineConfig(), index, host_arena(HostConfig(budget_bytes=1 << 20)), None)
    packed = prompt.tobytes()
    assert engine.match(LAYOUT, packed).pages == 1000
    return median_seconds(lambda: engine.match(LAYOUT, packed), repeat=101, warmup=5)


def main() -> None:
    prompt = random_keys(0, 2048)
    small, large = build(prompt, 0), build(prompt, 999_000)
    t_small, t_large = match_seconds(small, prompt), match_seconds(large, prompt)
    del large
    mem = bytes_per_page(prompt, 999_000)
    print_table("match of a 32k-token prompt (1000 pages hit)",
                ["index pages", "match p50 us", "ratio", "bytes/page"],
                [(1000, t_small * 1e6, 1.0, ""), (1_000_000, t_large * 1e6, t_large / t_small, mem)])
    print_summary(match_ratio_1m_vs_1k=t_large / t_small, bytes_per_page=mem,
                  match_1m_us=t_large * 1e6)


if __name__ == "__main__":
    main()
