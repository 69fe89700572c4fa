"""A GPU worker's outbox: stores whose rows are free again once copied on the GPU.

A store through the daemon frees the worker's rows only once the call has reached the
daemon and its copies ran: the way in, the daemon's bookkeeping, then the copy (on an
H100 a 32k-token store took 6-9 times a device-to-device copy of its bytes, RESULTS.md).
With an outbox, the worker first copies the rows into buffers of its own (one launch on
its current stream, the same kernel the daemon uses; a device-to-device copy of the same
bytes), and the daemon stores from there. The rows may be written again as soon as that
copy is done, in stream order, with no wait on the host; the call to the daemon goes from
a thread of the outbox's, and `Worker.post` hands back a future of its result.

The outbox's buffers are registered with the daemon as a second worker of the same
layout (the layout's fingerprint leaves out row counts, so both share one namespace) and
are read by the daemon's copies, after the call's ready word. They are written again only
once the daemon wrote the previous call's done word: the worker's stream waits for it
before it copies the next prompt in, so stores faster than the daemon wait on the GPU,
never on the host. The outbox costs its pages' bytes (and its checkpoints') of GPU memory.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, Protocol

import numpy as np
import torch

from tiercache.buffers import byte_rows
from tiercache.errors import FailedPrecondition, InvalidArgument
from tiercache.layout import BufferSpec, Layout
from tiercache.results import StoreResult
from tiercache.signals import Call, WorkerSignals
from tiercache.streams import current


class Sender(Protocol):
    """The outbox's registration as the daemon knows it (client._Remote)."""

    signals: WorkerSignals

    def store_signalled(self, prompt: Any, rows: np.ndarray, checkpoints: Mapping[int, int],
                        call: Call) -> StoreResult: ...
    def check_registered(self) -> None: ...
    def close(self) -> None: ...


def outbox_layout(layout: Layout, pages: int, checkpoints: int) -> Layout:
    """The layout of an outbox of `pages` pages and `checkpoints` state slots: the worker's,
    with those row counts (the same fingerprint)."""
    if pages <= 0 or (layout.slots and checkpoints <= 0):
        raise InvalidArgument(f"an outbox needs at least one page and, for a layout with state "
                              f"buffers, one checkpoint: got {pages} pages, {checkpoints} checkpoints")
    resized = lambda specs, rows: tuple(BufferSpec(b.name, rows, b.row_shape, b.dtype)  # noqa: E731
                                        for b in specs)
    return Layout(layout.page_tokens, resized(layout.paged, pages), resized(layout.slots, checkpoints),
                  layout.tp_rank, layout.tp_size, layout.model)


class _Copy:
    """One launch's tables: worker rows of one row size -> rows 0.. of the outbox's buffers."""

    def __init__(self, sources: list[torch.Tensor], targets: list[torch.Tensor], device: torch.device) -> None:
        from tiercache import kernels  # Triton: GPU machines only
        self._launch = kernels.copy_rows
        width = sources[0].shape[1]
        # the kernel writes row i of buffer b at entry_slot[i] + offset[b]: here the address
        # of the outbox buffer plus i rows of its width
        self.table = kernels.BufferTable.of(sources, [t.data_ptr() for t in targets], device)
        self.steps = torch.arange(targets[0].shape[0], dtype=torch.int64, device=device) * width

    def __call__(self, rows: torch.Tensor) -> None:  # on the current stream
        self._launch(self.table, rows, self.steps[:len(rows)], to_slots=True)


def _copies(sources: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor],
            specs: tuple[BufferSpec, ...], device: torch.device) -> list[_Copy]:
    """One copy per row size among `specs` (a launch's rows must share one width)."""
    widths: dict[int, list[BufferSpec]] = {}
    for b in specs:
        widths.setdefault(b.row_bytes, []).append(b)
    return [_Copy([byte_rows(sources[b.name], b) for b in group],
                  [targets[b.name] for b in group], device) for group in widths.values()]


class Outbox:
    """The worker's side of its outbox: the copies in, the ordering words, the sender."""

    def __init__(self, sender: Sender, layout: Layout, tensors: Mapping[str, torch.Tensor],
                 buffers: Mapping[str, torch.Tensor], boxed: Layout) -> None:
        self.device = next(iter(buffers.values())).device
        self.pages, self.checkpoints = boxed.page_rows, boxed.slot_rows
        self.page_rows, self.slot_rows = layout.page_rows, layout.slot_rows
        self.buffers = dict(buffers)  # kept: the daemon maps them until the sender closes
        self._sender = sender
        self._paged = _copies(tensors, buffers, layout.paged, self.device)
        self._slots = _copies(tensors, buffers, layout.slots, self.device)
        from tiercache import kernels
        kernels.prepare(self.device, {b.row_bytes for b in (*layout.paged, *layout.slots)})
        self._side = torch.cuda.Stream(self.device)  # where each call waits for its done word
        self._free: torch.cuda.Event | None = None  # the last call's done word reached
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tiercache-outbox")
        self._closed = False

    def fits(self, rows: np.ndarray, checkpoints: Mapping[int, int]) -> bool:
        return len(rows) <= self.pages and len(checkpoints) <= self.checkpoints

    def post(self, request: Callable[[], Any], rows: np.ndarray, checkpoints: Mapping[int, int]
             ) -> Future[StoreResult]:
        """Copy `rows` and the checkpoints' slots in on the current stream, then send the
        store (`request()` packs it, while the GPU copies): its future holds the daemon's
        reply (or its error)."""
        self._check(rows, checkpoints)
        order = sorted(checkpoints)
        ids = np.concatenate([rows, np.array([checkpoints[p] for p in order], np.int64)])
        stream = torch.cuda.current_stream(self.device)
        with self._lock, current(stream):  # one call at a time: the next waits for its word
            if self._closed:
                raise FailedPrecondition("this worker is closed: register again to store")
            self._sender.check_registered()
            if self._free is not None:
                stream.wait_event(self._free)  # the daemon has copied the last call's out
            # from pageable memory: the driver stages these few KiB before it returns, in
            # stream order, without waiting for the stream (page-locking them: 0.3-0.45 ms)
            on_device = torch.from_numpy(ids).to(self.device, non_blocking=True)
            for copy in self._paged:
                copy(on_device[:len(rows)])
            for copy in self._slots:
                copy(on_device[len(rows):])
            try:
                prompt = request()
            except BaseException:
                self._free = stream.record_event()  # the copy in, that no call reads
                raise
            self._side.wait_event(stream.record_event())
            with current(self._side), self._sender.signals.call() as call:
                call.await_done()
            self._free = self._side.record_event()
        boxed = {page: n for n, page in enumerate(order)}
        return self._thread.submit(self._sender.store_signalled, prompt,
                                   np.arange(len(rows), dtype=np.int64), boxed, call)

    def _check(self, rows: np.ndarray, checkpoints: Mapping[int, int]) -> None:
        """The worker's own rows are read by this process's launch: checked here (the daemon
        checks only the outbox's)."""
        for what, ids, limit in (("kv row", rows, self.page_rows),
                                 ("state slot", np.fromiter(checkpoints.values(), np.int64), self.slot_rows)):
            bad = ids[(ids < 0) | (ids >= limit)]
            if bad.size:
                raise InvalidArgument(f"{what} {int(bad[0])} is out of range: the worker has {limit}")

    def close(self) -> None:
        """Wait for the calls sent, then end the outbox's registration."""
        with self._lock:
            self._closed = True
        self._thread.shutdown(wait=True)
        self._sender.close()
