"""The same engine call, back to back and after the calling thread slept.

A daemon's calls arrive after idle gaps (a worker matches, prefills for tens of ms, then
stores), while an in-process loop runs hot: its caches, branch predictors and clock
are warm. This times one call of the engine, a match of a 32k-token prompt (2,048 pages
and a checkpoint, all cached in the host tier), in a loop with no gap and with the
thread asleep for 1, 10 and 100 ms before each call: what a step of the daemon costs
after an idle gap against what a hot loop in process says it costs.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from benchmarks.common import print_summary, print_table
from tiercache.buffers import WorkerBuffers
from tiercache.engine import Engine, EngineConfig
from tiercache.hashing import Namespace, key_array, page_keys
from tiercache.layout import BufferSpec, Layout
from tiercache.tiers.host import HostConfig

PAGES = 2048
LAYOUT = Layout(16, paged=(BufferSpec("kv", PAGES, (16, 8), "bfloat16"),),
                slots=(BufferSpec("state", 2, (64,), "float32"),))
GAPS_MS = (0, 1, 10, 100)


def call_us(call, gap_s: float, count: int) -> float:
    """Median microseconds of `call`, each after `gap_s` seconds asleep."""
    times = []
    for _ in range(count):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=64 << 20, pin=False)))
    buffers = WorkerBuffers.bind(LAYOUT, {"kv": torch.zeros(LAYOUT.paged[0].shape, dtype=torch.bfloat16)},
                                 {"state": torch.zeros(LAYOUT.slots[0].shape)})
    tokens = np.random.default_rng(0).integers(0, 150_000, PAGES * 16)
    keys = key_array(page_keys(tokens, Namespace("bench", LAYOUT.fingerprint).root(), 16))
    engine.store(buffers, keys, range(PAGES), {PAGES: 0})

    def match() -> None:
        assert engine.match(LAYOUT, keys).pages == PAGES
    call_us(match, 0, 200)  # warm up
    rows = []
    for gap in GAPS_MS:
        rows.append((gap, call_us(match, gap / 1e3, 200 if gap < 100 else 40)))
    hot = rows[0][1]
    engine.close()
    print_table("a 32k-token match in process (2,048 pages), after the thread slept",
                ["gap ms", "match us", "/ back to back"], [(g, us, us / hot) for g, us in rows])
    print_summary(**{f"after_{g}ms_over_hot": us / hot for g, us in rows[1:]}, hot_us=hot)


if __name__ == "__main__":
    main()
