"""A CUDA stream made its GPU's current stream for a block, cheaply; and a GPU's context
made current for the driver's own calls (`bind`).

`torch.cuda.stream(s)` does the same, but looks its devices up through
`torch.cuda.is_available()`, which reads an environment variable each time: 30-70 us a
use on an H100 host under a profiler, paid twice by every reload the daemon queues
(benchmarks/RESULTS.md, the twenty-sixth round of issue 15). Current streams are per
thread in torch, as here.
"""

from __future__ import annotations

import ctypes
import functools
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


# The driver's own calls (cuMemcpyBatchAsync, cuStreamWaitValue32, ...) act in the calling
# thread's current context. A thread that has made no CUDA runtime call yet has none, and
# `torch.cuda.device(d)` makes none current where d is already the thread's device: the
# driver then refuses a stream it cannot see (CUDA_ERROR_INVALID_VALUE: the daemon's
# background thread, whose first CUDA work was a copy down on the copy engines, H200,
# RESULTS.md, the thirtieth round of issue 15).
_primary: dict[int, int] = {}  # device index -> its primary context (retained, kept)


@functools.cache
def libcuda() -> ctypes.CDLL:
    """The driver's library, loaded once (OSError where there is none)."""
    return ctypes.CDLL("libcuda.so.1")


def checked(status: int, what: str) -> None:
    """Raise for a driver call's status other than success."""
    if status != 0:
        raise RuntimeError(f"{what} failed: CUDA error {status}")


def bind(device: int) -> None:
    """Make GPU `device`'s primary context (the one torch and the runtime use) the calling
    thread's current context, for the driver's calls that follow."""
    cuda = libcuda()
    context = _primary.get(device)
    if context is None:
        ordinal, retained = ctypes.c_int(), ctypes.c_void_p()
        checked(cuda.cuDeviceGet(ctypes.byref(ordinal), device), "cuDeviceGet")
        checked(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(retained), ordinal), "cuDevicePrimaryCtxRetain")
        context = _primary.setdefault(device, retained.value)
    now = ctypes.c_void_p()
    checked(cuda.cuCtxGetCurrent(ctypes.byref(now)), "cuCtxGetCurrent")
    if now.value != context:
        checked(cuda.cuCtxSetCurrent(ctypes.c_void_p(context)), "cuCtxSetCurrent")
