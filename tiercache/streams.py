"""A CUDA stream made its GPU's current stream for a block, cheaply.

`torch.cuda.stream(s)` does the same, but looks its devices up through
`torch.cuda.is_available()`, which reads an environment variable each time: 30-70 us a
use on an H100 host under a profiler, paid twice by every reload the daemon queues
(benchmarks/RESULTS.md, the twenty-sixth round of issue 15). Current streams are per
thread in torch, as here.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def current(stream: torch.cuda.Stream) -> Iterator[None]:
    """`stream` as the current stream of its GPU (which becomes the current GPU) inside the
    block; the current GPU and its stream as they were after it."""
    device = torch.cuda.current_device()
    previous = torch.cuda.current_stream(stream.device_index)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)
        if device != stream.device_index:
            torch.cuda.set_device(device)
