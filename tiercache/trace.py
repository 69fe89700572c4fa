"""Where a call's time goes, step by step, for benchmarks (`gpu_transfer --profile`).

Off unless TIERCACHE_TRACE names a file: then every step of a traced call (`call`)
records a span (`span`), each one synchronised with the GPU at both ends so that the
copies a step launched count in that step, and when the call ends one JSON line goes to
the file: {"call": NAME, "ms": {step: milliseconds}}. Synchronising changes what it
measures (no overlap between steps), which is the point of a breakdown and why it is
off by default; off, a span costs one attribute check.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Iterator

PATH = os.environ.get("TIERCACHE_TRACE", "")
# TIERCACHE_TRACE_SYNC=0: no synchronising, so steps overlap as they do untraced; each
# span is then the CPU's time in the step (a fence, its wait for the GPU)
SYNC = os.environ.get("TIERCACHE_TRACE_SYNC", "1") != "0"
_local = threading.local()
_write = threading.Lock()


def _sync() -> None:
    import torch
    if SYNC and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextmanager
def _timed(spans: dict[str, float], name: str) -> Iterator[None]:
    """Add the milliseconds of the block, synchronised with the GPU at both ends, to
    spans[name]."""
    _sync()
    start = time.perf_counter()
    try:
        yield
    finally:
        _sync()
        spans[name] = spans.get(name, 0.0) + (time.perf_counter() - start) * 1e3


@contextmanager
def _call(name: str) -> Iterator[None]:
    _local.spans = spans = {}
    try:
        with _timed(spans, "total"):
            yield
    finally:
        _local.spans = None
        with _write, open(PATH, "a") as f:
            f.write(json.dumps({"call": name, "ms": spans}) + "\n")


@contextmanager
def _span(name: str) -> Iterator[None]:
    spans = getattr(_local, "spans", None)
    if spans is None:
        yield
        return
    with _timed(spans, name):
        yield


def call(name: str):
    """A traced call: its spans go to the file as one line when it ends."""
    return _call(name) if PATH else nullcontext()


def span(name: str):
    """One step of the traced call on this thread (nothing outside a traced call)."""
    return _span(name) if PATH else nullcontext()
