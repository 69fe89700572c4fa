"""Moving rows between worker buffers and arena slots.

An entry is the concatenation of one row of every buffer in a group (the paged buffers
for a KV page, the slot buffers for a checkpoint), at the offsets the layout gives.
`gather` copies worker rows into entries, `scatter` copies entries into worker rows;
both take one call per batch, not one per row. The engine picks the path once per
worker, by where its buffers live:

- CpuTransfer: one vectorised copy per buffer on a few threads, reading or writing the
  arena side as a slice whenever the slots form a consecutive run (the usual case), so
  every byte is copied once. Synchronous.
- CudaTransfer: one Triton launch per batch over all buffers (kernels.py), reading or
  writing host memory itself where the slots are there; except, for slots in host
  memory, rows of 1 MiB and more, which go one by one on the copy engines
  (copy_engines.py), and shorter rows whose slots lie in long runs, which are staged
  through a ring of device memory (bulk copies of whole runs of entries on the copy
  engines, the launch device to device beside them). Entries with rows of both kinds
  that cannot be staged (too long, or in short runs) split: the long rows on the
  engines, the short ones by the launch. On this GPU's own streams; `fence` hands back
  the event that marks the batch done.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from tiercache import _rows, copy_engines, trace
from tiercache.streams import current
from tiercache.tiers.arena import SlabPart

log = logging.getLogger("tiercache")


class Transfer(Protocol):
    """A copy path between a worker's buffers and arena slots."""

    device: torch.device

    def gather(self, buffers: Sequence[torch.Tensor], offsets: Sequence[int], rows: np.ndarray,
               parts: Sequence[SlabPart]) -> None: ...
    def scatter(self, parts: Sequence[SlabPart], buffers: Sequence[torch.Tensor],
                offsets: Sequence[int], rows: np.ndarray) -> None: ...
    def copy_entries(self, parts: Sequence[SlabPart], addresses: np.ndarray) -> None: ...
    def wait_for(self, event: Any, direction: str) -> None: ...
    def fence(self, direction: str, interprocess: bool = False, into: Any = None) -> Any: ...
    def synchronize(self) -> None: ...
    def forget(self, buffers: Sequence[torch.Tensor]) -> None: ...
    def prepare(self, buffers: Sequence[torch.Tensor], offsets: Sequence[int]) -> None: ...
    def close(self) -> None: ...


INLINE_BYTES = 1 << 20  # CpuTransfer copies smaller batches on the calling thread


def _cpu_table(buffers: Sequence[torch.Tensor], offsets: Sequence[int], parts: Sequence[SlabPart],
               rows: np.ndarray) -> np.ndarray:
    """The buffers' table (copy_engines.buffer_table) for `_rows.copy_rows`, once every row
    and slot of the batch is checked to lie inside its buffer or slab: the copy trusts them."""
    table = copy_engines.buffer_table(buffers, offsets)
    if any(b.dtype != torch.uint8 or b.dim() != 2 for b in buffers):
        raise ValueError("CPU row copies take uint8 [rows, row bytes] buffers")
    ends = int((table[2] + table[3]).max(initial=0))
    for part in parts:
        if ends > part.slab.stride(0) or (len(part.local) and not (
                0 <= part.local.min() and part.local.max() < part.slab.shape[0])):
            raise ValueError("a slot or an entry's rows lie outside its slab")
    if len(rows) and buffers and not (0 <= rows.min() and rows.max() < min(b.shape[0] for b in buffers)):
        raise ValueError("a row lies outside the worker's buffers")
    return table


class CpuTransfer:
    device = torch.device("cpu")

    def __init__(self, threads: int = 2) -> None:
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def _copy(self, buffers: Sequence[torch.Tensor], offsets: Sequence[int], rows: np.ndarray,
              parts: Sequence[SlabPart], to_slots: bool) -> None:
        """Copy every part's rows (tiercache/_rows.c), its entries split between the copy
        threads; a batch under INLINE_BYTES on this thread (handing it to the pool and
        waiting took ~0.1 ms on the 2-core machine, about what copying 1 MiB takes)."""
        if not parts:
            return
        table = _cpu_table(buffers, offsets, parts, rows)
        jobs = [(np.ascontiguousarray(rows[p.positions], np.int64), p.addresses()) for p in parts]
        entries = sum(len(p.local) for p in parts)
        threads = self._threads if entries * int(table[2].sum()) >= INLINE_BYTES else 1
        # thread k takes the k-th run of each part's entries
        shares = list(zip(*[zip(np.array_split(r, threads), np.array_split(a, threads)) for r, a in jobs]))

        def run(share: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
            for entry_rows, addresses in share:
                if len(entry_rows):
                    _rows.copy_rows(table, entry_rows, addresses, to_slots)
        if threads < 2:
            run(shares[0])
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="tiercache-copy")
        for future in [self._pool.submit(run, share) for share in shares]:
            future.result()

    def gather(self, buffers: Sequence[torch.Tensor], offsets: Sequence[int],
               rows: np.ndarray, parts: Sequence[SlabPart]) -> None:
        """For each part: part.slab[part.local[i], entry bytes of buffer b] =
        buffers[b][rows[part.positions[i]]]."""
        self._copy(buffers, offsets, rows, parts, to_slots=True)

    def scatter(self, parts: Sequence[SlabPart], buffers: Sequence[torch.Tensor],
                offsets: Sequence[int], rows: np.ndarray) -> None:
        """For each part: buffers[b][rows[part.positions[i]]] = part.slab[part.local[i],
        entry bytes of buffer b]."""
        self._copy(buffers, offsets, rows, parts, to_slots=False)

    def copy_entries(self, parts: Sequence[SlabPart], addresses: np.ndarray) -> None:
        """Copy whole entries from arena slots (`parts`) to the slots at `addresses`, as
        CudaTransfer.copy_entries does (an arena in CPU memory serves as a device tier in
        tests of the tiers' logic)."""
        for part in parts:
            width = part.slab.shape[1]
            for source, at in zip(part.addresses().tolist(), addresses[part.positions].tolist()):
                ctypes.memmove(at, source, width)

    def wait_for(self, event: object, direction: str) -> None:
        """Copies here are synchronous: there is nothing to wait for."""

    def fence(self, direction: str, interprocess: bool = False, into: Any = None) -> "Done":
        return Done()

    def synchronize(self) -> None:
        pass

    def forget(self, buffers: Sequence[torch.Tensor]) -> None:
        pass  # nothing cached per buffer

    def prepare(self, buffers: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
        pass  # nothing to ready

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


class Done:
    """A finished copy (the CPU path copies synchronously)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


# Rows shorter than copy_engines.MIN_ROW_BYTES between worker buffers and host slots pass
# through a ring of device memory per direction: for a load, the copy engines move whole
# runs of slots from host memory into one half of the ring in bulk while the Triton
# launch scatters the other half's rows into the worker device to device; a store
# gathers into the ring and the engines copy it out. Measured on an H100 (2026-11-26,
# 512 MiB in 24 buffers, slots in one run, benchmarks.gpu_transfer's copy alone), ratio
# to one bulk copy, loads: rows of 4-64 KiB 0.95-0.98 staged against 0.92 by the launch
# reading host memory itself; stores 0.92-0.95 against 0.94-0.95. What decides it is the
# worker's own kernels: a launch that reads or writes host memory holds SMs for the
# whole copy, so 12 bf16 matmuls on the worker's stream took 1.5-1.6x as long beside a
# 512 MiB load or store by the launch, 0.95-1.03x beside a staged one (gpu_transfer
# --profile). Halves of 32 MiB gave 0.94-0.96; of 16 MiB, 0.92-0.97 at four times the
# CPU time (a scratch probe).
SLOW_SYNC = 10.0  # seconds a wait for a GPU's copies may take before the log says which
STAGE_BYTES = 64 << 20  # each half of a direction's ring (GPU memory, taken at first use)
MIN_RUN_BYTES = 1 << 20  # staged only where the slots' runs are this long on average
MAX_STAGED_ENTRY = STAGE_BYTES // 4  # longer entries keep their rows' own path
ROWS_KEPT = 8192  # worker rows a staged copy uploads into its ring's own memory, at most


def _pieces(addresses: np.ndarray, stride: int, slabs: np.ndarray | None, per_half: int
            ) -> tuple[np.ndarray, np.ndarray, int] | None:
    """What the copy engines move for a staged copy of the slots at `addresses`, `stride`
    bytes apart: runs of consecutive slots of one slab (`slabs` numbers them, None for
    one: a run never spans two allocations, even where one ends right where the next
    begins), cut where a half of the ring (`per_half` slots) ends. Returns where each
    piece starts, how many slots it holds, and how many runs there are before the cuts;
    None if the addresses are not ascending (tiercache/_rows.c)."""
    found = _rows.pieces(addresses, None if slabs is None else np.ascontiguousarray(slabs, np.int64),
                         stride, per_half)
    if found is None:
        return None
    starts, lengths, runs = found
    return np.frombuffer(starts, np.int64), np.frombuffer(lengths, np.int64), runs


class _Ring:
    """Two halves of device memory that a direction's staged copies pass through, in turn.
    A half is refilled only after the copy that read it last (its `free` event): the
    events are recorded under `lock`, so calls from several threads keep one order on the
    GPU. A staged copy's worker rows go up into `rows` (ROWS_KEPT of them; more into
    memory of their own), on the stream of the launches that read them."""

    def __init__(self, device: torch.device) -> None:
        self.memory = torch.empty((2, STAGE_BYTES), dtype=torch.uint8, device=device)
        self.bases = [half.data_ptr() for half in self.memory]
        self.rows = torch.empty(ROWS_KEPT, dtype=torch.int64, device=device)
        # recorded again at each turn: a wait queued on an event waits for its record then
        self.free = [torch.cuda.Event(), torch.cuda.Event()]  # the copy that read the half
        self.handed = [torch.cuda.Event(), torch.cuda.Event()]  # the half filled
        self.used = [False, False]  # whether `free` was recorded yet
        self.next = 0
        self.lock = threading.Lock()
        self._slots: dict[int, list[torch.Tensor]] = {}
        self._slot_addresses: dict[int, list[int]] = {}

    def slots(self, stride: int, stream: torch.cuda.Stream) -> list[int]:
        """Where each half's slot addresses lie for entries `stride` bytes apart (int64, on
        the GPU; made on `stream`, that of the launches that read them, at first use)."""
        if stride not in self._slots:
            with current(stream):
                at = torch.arange(STAGE_BYTES // stride, dtype=torch.int64, device=self.memory.device) * stride
                self._slots[stride] = [at + base for base in self.bases]
            self._slot_addresses[stride] = [t.data_ptr() for t in self._slots[stride]]
        return self._slot_addresses[stride]

    def take(self) -> int:
        half, self.next = self.next, 1 - self.next
        return half

    def upload(self, rows: np.ndarray, stream: torch.cuda.Stream) -> tuple[int, torch.Tensor | None]:
        """Where `rows` lie on the GPU once `stream` gets there, and what holds them if not
        `self.rows` (keep it until the launches that read them are queued)."""
        if len(rows) <= len(self.rows):
            copy_engines.upload(self.rows.data_ptr(), np.ascontiguousarray(rows, np.int64), stream)
            return self.rows.data_ptr(), None
        with current(stream):  # its memory freed in the stream's order, after the launches
            held = torch.from_numpy(np.ascontiguousarray(rows, np.int64)).to(self.rows.device, non_blocking=True)
        return held.data_ptr(), held


class CudaTransfer:
    """Owns one GPU's copy streams and events. Worker rows go to slots (stores) on one
    stream and slots come to worker rows (loads) on another, so a large store never
    delays a load; each direction keeps its launches in order, and a caller waits for
    exactly its own work through the event `fence` records, never for the whole device.
    Staged copies (above) cross PCIe on a second stream of their direction."""

    def __init__(self, device: torch.device, streams: dict[str, torch.cuda.Stream]) -> None:
        self.device = device
        self._streams = streams
        # by id of the buffers: their table, and that of their rows shorter than
        # copy_engines.MIN_ROW_BYTES (None where all are, or none)
        self._tables: dict[int, tuple[Sequence[torch.Tensor], Any, Any]] = {}
        self._engines = copy_engines.available()  # until the driver refuses a batch
        self._rings: dict[str, _Ring | None] = {}
        self._rings_lock = threading.Lock()

    @classmethod
    def open(cls, device: torch.device) -> "CudaTransfer":
        with torch.cuda.device(device):
            # a worker waits for its stores and loads; nobody waits for the moves between
            # tiers behind them: the GPU schedules the waited-for copies' blocks first
            return cls(device, {"store": torch.cuda.Stream(priority=-1),
                                "load": torch.cuda.Stream(priority=-1),
                                "store pcie": torch.cuda.Stream(priority=-1),
                                "load pcie": torch.cuda.Stream(priority=-1),
                                "move": torch.cuda.Stream(priority=0)})

    @property
    def streams(self) -> list[torch.cuda.Stream]:
        return list(self._streams.values())

    def wait_for(self, event: torch.cuda.Event | None, direction: str) -> None:
        """Order this direction's next copies into or out of the worker's rows after
        `event` (the worker's own work; a staged load's copies into its ring need not
        wait)."""
        if event is not None:
            self._streams[direction].wait_event(event)

    def _table(self, buffers: Sequence[torch.Tensor], offsets: Sequence[int]) -> tuple[Any, Any]:
        """The kernel's buffer table, and the table of the buffers whose rows are shorter
        than copy_engines.MIN_ROW_BYTES where some are longer (else None): built once per
        group of registered buffers."""
        from tiercache.kernels import BufferTable  # Triton only where there is a GPU
        cached = self._tables.get(id(buffers))
        if cached is None:
            short = [b.shape[1] < copy_engines.MIN_ROW_BYTES for b in buffers]
            mixed = any(short) and not all(short)
            cached = self._tables[id(buffers)] = (
                buffers, BufferTable.of(buffers, offsets, self.device),
                BufferTable.of([b for b, s in zip(buffers, short) if s],
                               [at for at, s in zip(offsets, short) if s], self.device) if mixed else None)
        return cached[1], cached[2]

    def forget(self, buffers: Sequence[torch.Tensor]) -> None:
        """Drop what was cached for buffers that are going away."""
        self._tables.pop(id(buffers), None)

    def prepare(self, buffers: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
        """Build the buffers' tables, and load the kernels that copy their rows and move
        their entries between tiers (kernels.prepare: a kernel's first load waits for the
        GPU's queued copies)."""
        from tiercache.kernels import prepare  # Triton only where there is a GPU
        table, short = self._table(buffers, offsets)
        widths = [table.min_width, sum(b.shape[1] for b in buffers)]
        prepare(self.device, widths + ([short.min_width] if short is not None else []))

    def _launch(self, buffers: Sequence[torch.Tensor], offsets: Sequence[int], rows: np.ndarray,
                parts: Sequence[SlabPart], to_slots: bool) -> None:
        """Copy the rows of every part: slots in device memory by one launch, slots in host
        memory by the path their rows and runs call for (the module's docstring)."""
        direction = "store" if to_slots else "load"
        table, short = self._table(buffers, offsets)
        for on_device in (True, False):
            chosen = [p for p in parts if p.slab.is_cuda == on_device]
            if not chosen:
                continue
            addresses = np.concatenate([p.addresses() for p in chosen])
            entry_rows = np.concatenate([rows[p.positions] for p in chosen])
            if on_device:
                self._run(table, entry_rows, addresses, to_slots, direction)
            elif table.min_width >= copy_engines.MIN_ROW_BYTES:
                self._run(table, entry_rows, addresses, to_slots, direction, engines=True)
            elif not self._staged(table, entry_rows, addresses, chosen, to_slots, direction):
                # entries of long and short rows (a Qwen3-Next checkpoint: 2 MiB recurrent
                # states beside 48 KiB conv states, 74 MiB, too long to stage): the long
                # rows on the engines if they take them, the rest by the launch
                long = table.host[:, table.host[2] >= copy_engines.MIN_ROW_BYTES]
                rest = short if short is not None and self._rows_on_engines(
                    long, entry_rows, addresses, to_slots, direction) else table
                self._run(rest, entry_rows, addresses, to_slots, direction)

    def _staged(self, table: Any, rows: np.ndarray, addresses: np.ndarray,
                parts: Sequence[SlabPart], to_slots: bool, direction: str) -> bool:
        """Copy through the direction's ring (the module's note) if the slots of `parts`
        (in host memory; `addresses` and `rows` are theirs, in order) lie in long runs;
        False, with nothing queued, if they do not."""
        strides = {p.slab.stride(0) for p in parts}
        stride = strides.pop() if len(strides) == 1 else 0
        if not self._engines or not 0 < stride <= MAX_STAGED_ENTRY:
            return False
        slabs = np.repeat(np.arange(len(parts)), [len(p.local) for p in parts]) if len(parts) > 1 else None
        per_half = STAGE_BYTES // stride
        found = _pieces(addresses, stride, slabs, per_half)
        if found is None:  # usually in order already
            order = np.argsort(addresses, kind="stable")
            addresses, rows = addresses[order], rows[order]
            found = _pieces(addresses, stride, None if slabs is None else slabs[order], per_half)
        starts, lengths, runs = found
        if len(addresses) * stride < MIN_RUN_BYTES * runs:
            return False
        # each piece's source, place in its half of the ring, and size; the pieces of each
        # turn of the ring (a half's worth of slots) lie between two bounds
        sources = addresses[starts].astype(np.uint64)
        places = ((starts % per_half) * stride).astype(np.uint64)
        sizes = (lengths * stride).astype(np.uint64)
        bounds = np.searchsorted(starts, np.arange(0, len(rows) + per_half, per_half)).tolist()
        from tiercache.kernels import launch  # Triton only where there is a GPU
        ring = self._ring(direction)
        if ring is None:
            return False
        kernel, pcie = self._streams[direction], self._streams[direction + " pcie"]
        # a load copies a half in, then scatters it; a store gathers, then copies it out
        first, then = (kernel, pcie) if to_slots else (pcie, kernel)
        done = 0
        try:
            with ring.lock, torch.cuda.device(self.device):  # the launches' device and context
                # the rows, uploaded right before the first launch: a load's first copy into
                # the ring is queued before them
                uploaded: tuple[int, torch.Tensor | None] | None = None
                for done in range(0, len(rows), per_half):
                    half, turn = ring.take(), done // per_half
                    pieces = slice(bounds[turn], bounds[turn + 1])
                    count = min(per_half, len(rows) - done)
                    staged = places[pieces] + np.uint64(ring.bases[half])
                    ends = (sources[pieces], staged) if to_slots else (staged, sources[pieces])  # to, from
                    if ring.used[half]:  # the copy that read this half last
                        first.wait_event(ring.free[half])
                    for stream in (first, then):
                        with trace.gpu(direction, stream):
                            if stream is pcie:
                                copy_engines.copy(*ends, sizes[pieces], pcie)
                            else:
                                if uploaded is None:  # from pageable memory, by the driver
                                    uploaded = ring.upload(rows, kernel)
                                launch(table, uploaded[0] + 8 * done, ring.slots(stride, kernel)[half], count,
                                       to_slots, kernel.device_index, kernel.cuda_stream)
                        if stream is first:
                            ring.handed[half].record(first)
                            then.wait_event(ring.handed[half])
                    ring.free[half].record(then)
                    ring.used[half] = True
        except copy_engines.CopyEngineError as error:
            self._engines_refused(error)
            remaining = slice(done, None)  # the launch copies what the engines did not
            self._run(table, rows[remaining], addresses[remaining], to_slots, direction)
        return True

    def _ring(self, direction: str) -> _Ring | None:
        """The direction's ring, made at first use; None if the GPU had no room for it
        (then that direction copies by the launch from now on, said once)."""
        with self._rings_lock:
            if direction not in self._rings:
                try:
                    with torch.cuda.device(self.device):
                        self._rings[direction] = _Ring(self.device)
                except torch.cuda.OutOfMemoryError:
                    self._rings[direction] = None
                    log.warning("no room on %s for the %d MiB that %ss between the worker and "
                                "host memory pass through: they take SMs from the worker's "
                                "kernels while they run (free GPU memory and restart the "
                                "daemon to stage them)", self.device, 2 * STAGE_BYTES >> 20,
                                direction)
            return self._rings[direction]

    def _engines_refused(self, error: Exception) -> None:
        self._engines = False
        log.warning("the GPU's copy engines refused a batch (%s): host-tier copies go by the "
                    "copy kernel from now on", error)

    def _run(self, table: Any, rows: np.ndarray, addresses: np.ndarray, to_slots: bool,
             direction: str, engines: bool = False) -> None:
        """Copy row rows[i] of every buffer of `table` to (or from) the slot at addresses[i]:
        on the copy engines if asked (where the driver has them), else in one Triton
        launch."""
        from tiercache.kernels import copy_rows  # Triton only where there is a GPU
        stream = self._streams[direction]
        if engines and self._rows_on_engines(table.host, rows, addresses, to_slots, direction):
            return
        meta = np.empty((2, len(rows)), np.int64)
        meta[0], meta[1] = rows, addresses
        with current(stream), trace.gpu(direction, stream):
            # from pageable memory: the driver stages these few KiB before it returns, in
            # stream order, in 15-25 us of CPU (H200, up to 43 KiB). Page-locking them took
            # ~0.5 ms a launch, a new block whenever the last one was still in use by a copy
            # in flight; copied through page-locked blocks kept for it, 75-95 us (RESULTS.md)
            on_device = torch.from_numpy(meta).to(self.device, non_blocking=True)
            copy_rows(table, on_device[0], on_device[1], to_slots, stream)

    def _rows_on_engines(self, host_table: np.ndarray, rows: np.ndarray, addresses: np.ndarray,
                         to_slots: bool, direction: str) -> bool:
        """Queue row rows[i] of every buffer of `host_table` (BufferTable.host's columns) to
        (or from) the slot at addresses[i] on the copy engines; False, with nothing queued,
        where the driver has none or refused them."""
        if not self._engines:
            return False
        worker, slots, sizes = copy_engines.row_addresses(host_table, rows, addresses)
        dst, src = (slots, worker) if to_slots else (worker, slots)
        return self._on_engines(dst, src, sizes, direction)

    def _on_engines(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                    direction: str) -> bool:
        """Queue the copies on the copy engines on the direction's stream; False, with
        nothing queued, if the driver refused them (then the caller's kernel copies them,
        and every copy after them goes by the kernel)."""
        stream = self._streams[direction]
        try:  # copy_engines.copy makes the GPU's context current for the driver; this, its device
            with torch.cuda.device(self.device), trace.gpu(direction, stream):
                copy_engines.copy(dsts, srcs, sizes, stream)
            return True
        except copy_engines.CopyEngineError as error:
            self._engines_refused(error)
            return False

    def gather(self, buffers: Sequence[torch.Tensor], offsets: Sequence[int],
               rows: np.ndarray, parts: Sequence[SlabPart]) -> None:
        self._launch(buffers, offsets, rows, parts, to_slots=True)

    def scatter(self, parts: Sequence[SlabPart], buffers: Sequence[torch.Tensor],
                offsets: Sequence[int], rows: np.ndarray) -> None:
        self._launch(buffers, offsets, rows, parts, to_slots=False)

    def copy_entries(self, parts: Sequence[SlabPart], addresses: np.ndarray) -> None:
        """Copy whole entries from slots of this GPU's arena (`parts`) to the slots at
        `addresses` (in host memory, all in one slab), on the "move" stream: entries of
        MIN_MOVE_BYTES and more on the copy engines, each run of slots that follow one
        another on both sides as one copy; shorter ones by one launch per slab, the slab
        seen as a buffer whose rows are its slots."""
        from tiercache.kernels import BufferTable
        for part in parts:
            width = part.slab.shape[1]
            if self._engines and width >= copy_engines.MIN_MOVE_BYTES:
                copies = copy_engines.joined(addresses[part.positions].astype(np.uint64),
                                             part.addresses().astype(np.uint64),
                                             np.full(len(part.local), width, np.uint64))
                if self._on_engines(*copies, "move"):
                    continue
            # a table per slab and call: slabs come and go, and a cached one would keep a
            # released slab alive (or, keyed by address, mistake a new one). It is made on
            # the stream that reads it: freed after this call, its memory is reused only by
            # work queued behind the launch (made on another stream, the next table
            # overwrote it under the running kernel: illegal addresses on the H100)
            with current(self._streams["move"]):
                table = BufferTable.of((part.slab,), [0], self.device)
            self._run(table, part.local, addresses[part.positions], True, "move")

    def fence(self, direction: str, interprocess: bool = False,
              into: torch.cuda.Event | None = None) -> torch.cuda.Event:
        """An event that completes when every copy launched so far in `direction` has:
        `into`, recorded again, or a new one."""
        event = into if into is not None else torch.cuda.Event(interprocess=interprocess)
        stream = self._streams[direction]
        if direction == "store":  # a staged store's last copies are on its PCIe stream
            pcie = self._streams["store pcie"]
            pcie.wait_stream(stream)
            stream = pcie
        event.record(stream)
        return event

    def synchronize(self) -> None:
        """Wait for every copy queued on this GPU; say which streams still copy after
        SLOW_SYNC seconds (they wait for a worker's GPU work, or hang: README, Failures)."""
        started, said = time.monotonic(), False
        for stream in self._streams.values():
            while not said and not stream.query():
                time.sleep(0.001)
                if time.monotonic() - started >= SLOW_SYNC:
                    said = True
                    log.warning("the copy streams %s on %s still run after %.0f s: they wait "
                                "for a worker's GPU work, or hang (README, Failures)",
                                [n for n, s in self._streams.items() if not s.query()],
                                self.device, SLOW_SYNC)
            stream.synchronize()

    def close(self) -> None:
        self.synchronize()
        self._rings.clear()
