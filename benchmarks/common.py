"""What every benchmark shares: timing, the machine's name, a table and a summary line."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable, Sequence


def median_seconds(fn: Callable[[], object], repeat: int = 7, warmup: int = 1,
                   setup: Callable[[], object] | None = None) -> float:
    """Median wall time of `fn`; `setup` runs before each call, untimed."""
    return statistics.median(_times(fn, repeat, warmup, setup))


def best_seconds(fn: Callable[[], object], repeat: int = 7, warmup: int = 1) -> float:
    """Shortest wall time of `fn`: for a physical limit beside ours (a bulk copy), whose
    slower runs say only what else the machine was doing (once 35 GB/s where it gives 54)."""
    return min(_times(fn, repeat, warmup, None))


def _times(fn: Callable[[], object], repeat: int, warmup: int,
           setup: Callable[[], object] | None) -> list[float]:
    times = []
    for n in range(warmup + repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        if n >= warmup:
            times.append(time.perf_counter() - start)
    return times


def machine() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} / {os.cpu_count()} cores"
    except ImportError:
        pass
    return f"{platform.machine()} {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(f"\n{title}  [{machine()}, {time.strftime('%Y-%m-%d')}]")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def print_summary(**values: float) -> None:
    print("summary: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in values.items()))
