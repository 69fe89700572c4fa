"""Where a call's time goes, step by step, for benchmarks (`gpu_transfer --profile`).

Off unless TIERCACHE_TRACE names a file: then every step of a traced call (`call`)
records a span (`span`), each one synchronised with the GPU at both ends so that the
copies a step launched count in that step, and when the call ends one JSON line goes to
the file: {"call": NAME, "at": ms, "ms": {step: milliseconds}, "from": {step: ms after the
call's start}, "gpu": [[name, issued, started, ended], ...]}. "at" is the call's start on
the host's monotonic clock (time.perf_counter, shared by the processes of a machine, so
a worker can place the call on its own timeline); "gpu" places each copy (`gpu`) on the
same timeline: when the CPU queued it and when the GPU began and ended it, in ms after
the call's start. Synchronising changes what it measures (no overlap between steps),
which is the point of a breakdown and why it is off by default; off, a span costs one
attribute check.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

PATH = os.environ.get("TIERCACHE_TRACE", "")
# TIERCACHE_TRACE_SYNC=0: no synchronising, so steps overlap as they do untraced; each
# span is then the CPU's time in the step (a fence, its wait for the GPU)
SYNC = os.environ.get("TIERCACHE_TRACE_SYNC", "1") != "0"
_local = threading.local()
_lines: "queue.Queue[tuple[dict, Any, list] | None]" = queue.Queue()
_writer: threading.Thread | None = None
_start_writer = threading.Lock()


_in_use: Any = None  # torch, once the GPU is in use in this process


def _cuda() -> Any:
    """torch, where the GPU is in use in this process; else None. Asked of torch until it
    is, then kept: `torch.cuda.is_available()` reads an environment variable each time,
    tens of microseconds a step of a traced call (tiercache/streams.py)."""
    global _in_use
    if _in_use is None:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            _in_use = torch
    return _in_use


def _sync() -> None:
    torch = _cuda() if SYNC else None
    if torch is not None:
        torch.cuda.synchronize()


def _now() -> float:
    return time.perf_counter() * 1e3


@contextmanager
def _timed(spans: dict[str, float], name: str) -> Iterator[None]:
    """Add the milliseconds of the block, synchronised with the GPU at both ends, to
    spans[name]; note when the step first started."""
    _sync()
    start = _now()
    starts = getattr(_local, "starts", None)
    if starts is not None and name not in starts:
        starts[name] = start - _local.at
    try:
        yield
    finally:
        _sync()
        spans[name] = spans.get(name, 0.0) + _now() - start


def _write_lines() -> None:
    """Write the records in the order their calls ended, each once its copies are done
    (their GPU times are known only then), so that a call is never held up for this."""
    while (item := _lines.get()) is not None:
        record, reference, copies = item
        record["gpu"] = []
        for name, issued, started, ended in copies:
            ended.synchronize()
            record["gpu"].append([name, issued, reference.elapsed_time(started),
                                  reference.elapsed_time(ended)])
        with open(PATH, "a") as f:
            f.write(json.dumps(record) + "\n")


def _drain() -> None:
    if _writer is not None:
        _lines.put(None)
        _writer.join()


def _emit(record: dict, reference: Any, copies: list) -> None:
    global _writer
    with _start_writer:
        if _writer is None:
            _writer = threading.Thread(target=_write_lines, name="tiercache-trace", daemon=True)
            _writer.start()
            atexit.register(_drain)  # the lines of the last calls, before the process ends
    _lines.put((record, reference, copies))


@contextmanager
def _call(name: str) -> Iterator[None]:
    torch = _cuda()
    reference = None
    if torch is not None:  # the GPU's clock at the call's start: an event on an idle stream
        reference = torch.cuda.Event(enable_timing=True)
        reference.record(torch.cuda.current_stream())
    _local.spans, _local.starts, _local.copies, _local.at = {}, {}, [], _now()
    record = {"call": name, "at": _local.at, "ms": _local.spans, "from": _local.starts}
    copies = _local.copies
    try:
        with _timed(_local.spans, "total"):
            yield
    finally:
        _local.spans = _local.starts = _local.copies = None
        _emit(record, reference, copies if reference is not None else [])


@contextmanager
def _span(name: str) -> Iterator[None]:
    spans = getattr(_local, "spans", None)
    if spans is None:
        yield
        return
    with _timed(spans, name):
        yield


@contextmanager
def _gpu(name: str, stream: Any) -> Iterator[None]:
    copies = getattr(_local, "copies", None)
    torch = _cuda() if copies is not None else None
    if torch is None:
        yield
        return
    started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    issued = _now() - _local.at
    started.record(stream)
    yield
    ended.record(stream)
    copies.append((name, issued, started, ended))


def call(name: str):
    """A traced call: its spans go to the file as one line when it ends."""
    return _call(name) if PATH else nullcontext()


def span(name: str):
    """One step of the traced call on this thread (nothing outside a traced call)."""
    return _span(name) if PATH else nullcontext()


def gpu(name: str, stream: Any):
    """Work queued on `stream` inside the block, placed on the traced call's timeline."""
    return _gpu(name, stream) if PATH else nullcontext()
