"""The order of a GPU worker's stream and the daemon's copies, through 32-bit words in the
worker's GPU memory that either process can write (RegisterRequest.signals).

A GPU call takes a slot and a value. The worker's stream writes the value into the
slot's ready word after its last use of the call's rows, and the daemon's copies wait
until the word reaches it (cuStreamWaitValue32, a cyclic comparison). The daemon writes
the value into the slot's done word once none of the call's copies remain queued: after
them for an asynchronous call, at its end for any other (a miss, an error, a call that
waited for its copies). The worker's stream waits on that word when copies may still be
queued: after an asynchronous reply, and after a call that failed without a reply it can
trust. A call whose request the daemon may never have handled (its deadline passed) is
settled (`DaemonSignals.settle`, the Settle RPC): the daemon says it handled it, so it
writes the word, or refuses it from then on and writes the word itself.

Interprocess CUDA events did all of this before. But an event whose recorder dies with
its record still queued never completes, and recording it again elsewhere does not
release a wait on it; a record, queued by the daemon, of an event of a worker that died
meanwhile blocks the daemon's stream for good (H100, RESULTS.md). A word is written by
whoever survives (`DaemonSignals.release`, `WorkerSignals.release`), and the daemon
records no event of a worker that gives words. The daemon's copies into a dead
worker's memory still run (harmlessly: the daemon's mapping keeps it); a dead daemon's
queued copies do not run at all.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from tiercache import cuda_ipc
from tiercache.errors import FailedPrecondition, InvalidArgument
from tiercache.streams import bind, current

SLOTS = 1024  # a worker's calls in flight at once, at most (more wait for a slot)
MAX_SLOTS = 1 << 16
WORD = 4


def _driver() -> Any:
    from cuda.bindings import driver  # GPU machines only, as cuda_ipc
    return driver


def _checked(result: tuple, what: str) -> None:
    if int(result[0]) != 0:
        raise RuntimeError(f"{what} failed: {result[0]!r}")


# The driver's calls act in the calling thread's current context: a stream of another GPU
# than the current one is refused (CUDA_ERROR_INVALID_VALUE, a worker on a second GPU of
# its process), and so is any on a thread with no context yet. So each call makes the
# stream's GPU current for its length, and its context current (streams.bind).
def wait_value(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Queue on `stream` a wait until the word at `address` reaches `value` (cyclic)."""
    d = _driver()
    with torch.cuda.device(stream.device):
        bind(stream.device_index)
        _checked(d.cuStreamWaitValue32(d.CUstream(stream.cuda_stream), d.CUdeviceptr(address),
                                       d.cuuint32_t(value), d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
                 "cuStreamWaitValue32")


def write_value(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Queue on `stream` a write of `value` into the word at `address`."""
    d = _driver()
    with torch.cuda.device(stream.device):
        bind(stream.device_index)
        _checked(d.cuStreamWriteValue32(d.CUstream(stream.cuda_stream), d.CUdeviceptr(address),
                                        d.cuuint32_t(value),
                                        d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
                 "cuStreamWriteValue32")


_OWN: dict[int, torch.cuda.ExternalStream] = {}
_OWN_LOCK = threading.Lock()


def own_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A CUDA stream of this module's, made once per device, that nothing else uses:
    torch.cuda.Stream() hands out streams from a pool of 32, round robin, so one may be
    a stream stuck on a word (it deadlocked a daemon's release on an H100)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _OWN_LOCK:
        if index not in _OWN:
            from cuda.bindings import runtime
            with torch.cuda.device(index):
                status, handle = runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking)
                if int(status) != 0:
                    raise RuntimeError(f"cudaStreamCreateWithFlags failed: {status!r}")
                _OWN[index] = torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", index))
        return _OWN[index]


def _release(device: torch.device, words: dict[int, int]) -> None:
    """Write each word (address -> value) now, on a stream of our own (the streams that
    wait on them may be stuck, this one is not), and return once written."""
    if not words:
        return
    side = own_stream(device)
    with _OWN_LOCK:  # one writer at a time on the one stream
        for address, value in words.items():
            write_value(side, address, value)
        side.synchronize()


def _at_least(word: int, value: int) -> bool:
    """Whether `word` has reached `value`, as a stream's wait compares them (cyclic)."""
    return (word - value) & 0xFFFFFFFF < 0x80000000


# -- the worker's side ----------------------------------------------------------------------
class WorkerSignals:
    """A worker's words, in an allocation of their own (they are handed to the daemon by
    CUDA IPC), and its calls in flight."""

    def __init__(self, device: torch.device, slots: int = SLOTS) -> None:
        from cuda.bindings import runtime
        self.device, self.slots = device, slots
        with torch.cuda.device(device):
            status, address = runtime.cudaMalloc(2 * slots * WORD)
            if int(status) != 0:
                raise RuntimeError(f"cudaMalloc of the worker's signal words failed: {status!r}")
        self._address = int(address)
        self.words = torch.as_tensor(cuda_ipc._DeviceArray(self._address, 2 * slots * WORD),
                                     device=device).view(torch.int32)
        self.words.zero_()
        torch.cuda.synchronize(device)
        self.exported = cuda_ipc.export(self.words)
        self._lock = threading.Lock()
        self._value = 0
        self._next = 0
        self._ends: list[torch.cuda.Event | None] = [None] * slots  # each slot's last call, done
        self._awaited: dict[int, int] = {}  # slot -> value its done word is waited for at
        self._side = own_stream(device)  # for what must not queue behind the worker's work
        self._writer = torch.cuda.Stream(device)  # ready words behind a caller's own event
        try:  # raises where the driver has no stream memory operations
            write_value(self._side, self.done_word(0), 0)
            wait_value(self._side, self.done_word(0), 0)
            self._side.synchronize()
        except RuntimeError:
            self.close()
            raise
        self.released = 0  # done waits this worker released itself (the daemon died)

    def ready_word(self, slot: int) -> int:
        return self._address + slot * WORD

    def done_word(self, slot: int) -> int:
        return self._address + (self.slots + slot) * WORD

    @contextmanager
    def call(self, given: torch.cuda.Event | None = None, deferred: bool = False) -> Iterator["Call"]:
        """A slot and value for one call, its ready word written on the current stream now
        (after all work queued on it so far), or after the caller's `given` event on a
        stream of this worker's. With `deferred`, the word is written at the call's
        `ready()`, or when the block ends if that comes first: the caller queues nothing on
        the stream meanwhile, and calls `ready()` once its request is on its way, before it
        waits for the reply (the daemon's wait for the word is queued on the GPU, so the
        write need not come before the request). The slot is taken again once every
        stream the call used has passed the point where the block ended."""
        stream = torch.cuda.current_stream(self.device)
        slot, value = self._take()
        writer = stream
        if given is not None:
            writer = self._writer
            writer.wait_event(given)
        call = Call(self, slot, value, stream, lambda: write_value(writer, self.ready_word(slot), value))
        if not deferred:
            call.ready()
        try:
            yield call
        finally:
            try:
                call.ready()  # on every way out: the daemon's copies may wait for it
            finally:
                self._ends[slot] = [stream.record_event(),
                                    *([writer.record_event()] if writer is not stream else [])]

    def _take(self) -> tuple[int, int]:
        """A free slot (one whose last call's words were all written and waited on: a
        value written later could otherwise land before an earlier one) and the next value."""
        while True:
            with self._lock:
                for _ in range(self.slots):
                    slot, self._next = self._next, (self._next + 1) % self.slots
                    ends = self._ends[slot]
                    if ends is None or all(end.query() for end in ends):
                        self._ends[slot] = None
                        self._value = self._value % 0xFFFFFFFF + 1  # never 0: 0 names no call
                        return slot, self._value
                oldest = self._ends[self._next]
            for end in oldest or ():  # every slot in flight: wait for the next one's streams
                end.synchronize()

    def awaited(self, slot: int, value: int, stream: torch.cuda.Stream) -> None:
        with self._lock:
            self._awaited[slot] = value
        wait_value(stream, self.done_word(slot), value)

    def _missing(self) -> dict[int, int]:
        """Done words (address -> value) that the worker's streams wait on and the daemon
        has not written yet (read on a stream of this worker's, not the waiting ones)."""
        with self._lock:
            awaited = dict(self._awaited)
        if not awaited:
            return {}
        with current(self._side):
            done = self.words[self.slots:].to("cpu")
        missing = {}
        for slot, value in awaited.items():
            if not _at_least(int(done[slot]), value):
                missing[self.done_word(slot)] = value
            else:
                with self._lock:
                    if self._awaited.get(slot) == value:
                        del self._awaited[slot]
        return missing

    def waiting(self) -> bool:
        """Whether a stream of this worker's still waits on a done word the daemon has
        not written."""
        return bool(self._missing())

    def release_one(self, slot: int, value: int) -> None:
        """Write one call's done word: no copies of it are queued, nor ever will be (the
        daemon no longer holds this registration)."""
        with self._lock:
            if self._awaited.get(slot) == value:
                del self._awaited[slot]
        _release(self.device, {self.done_word(slot): value})

    def release(self) -> int:
        """Write the done words this worker's streams still wait on: the daemon died with
        their copies queued, and those will never run (the rows hold what they held).
        Returns how many."""
        missing = self._missing()
        _release(self.device, missing)
        with self._lock:
            self._awaited.clear()
            self.released += len(missing)
        return len(missing)

    def close(self) -> None:
        from cuda.bindings import runtime
        with torch.cuda.device(self.device):
            self._side.synchronize()
            runtime.cudaFree(self._address)  # waits for the work using it


class Call:
    """One call's place in the words (its slot and value)."""

    def __init__(self, signals: WorkerSignals, slot: int, value: int, stream: torch.cuda.Stream,
                 write: Callable[[], None]) -> None:
        self._signals, self.slot, self.value, self._stream = signals, slot, value, stream
        self._write: Callable[[], None] | None = write

    def ready(self) -> None:
        """Queue the write of the call's ready word, if not yet (WorkerSignals.call)."""
        write, self._write = self._write, None
        if write is not None:
            write()

    def await_done(self) -> None:
        """Queue the worker's stream behind the daemon's write of the done word (the
        daemon replied that the copies are queued)."""
        self._signals.awaited(self.slot, self.value, self._stream)


def process_started(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (the same in every PID
    namespace), or None if this process cannot see it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


# -- the daemon's side ----------------------------------------------------------------------
class DaemonSignals:
    """A worker's words as the daemon opened them, and the waits it queued on them."""

    def __init__(self, opened: cuda_ipc.Opened, offset: int, nbytes: int) -> None:
        if nbytes % (2 * WORD) or not 0 < nbytes // (2 * WORD) <= MAX_SLOTS:
            raise InvalidArgument(f"signals are 8 bytes per slot, 1 to {MAX_SLOTS} slots: got "
                                  f"{nbytes} bytes")
        opened.view(offset, nbytes)  # raises if it runs past the allocation
        self.slots = nbytes // (2 * WORD)
        self.device = torch.device("cuda", opened.device)
        self._base = opened.address + offset
        self.lock = threading.Lock()
        self._waits: list[ReadyWait] = []
        self.released = False
        self._handled: dict[int, int] = {}  # slot -> the latest value a call of it came with
        self._settled: dict[int, int] = {}  # slot -> a value settled before its call came

    @contextmanager
    def call(self, slot: int, value: int) -> Iterator[tuple["ReadyWait", "DoneMark"]]:
        """One call's ready wait and done mark. The done word is written when the block
        ends, unless the call's copies queued it (DoneMark.record): the caller must leave
        none of the call's copies queued when it raises. A call its worker settled
        before it came (`settle`) is refused, with nothing done."""
        self._check(slot, value)
        with self.lock:
            if self._settled.get(slot) == value:
                raise FailedPrecondition(f"the call of signal slot {slot} (value {value}) came "
                                         "after its worker settled it: nothing was done")
            self._handled[slot] = value
        done = DoneMark(self, self._done_word(slot), value)
        try:
            yield self.ready(slot, value), done
        finally:
            done.end()

    def settle(self, slot: int, value: int) -> bool:
        """A call its worker got no reply to: True if it came (its done word is, or will
        be, written when its copies are done); else it never will be handled, and its
        done word is written now."""
        self._check(slot, value)
        with self.lock:
            handled = self._handled.get(slot)
            if handled is not None and _at_least(handled, value):  # or a later call of the slot
                return True
            self._settled[slot] = value
        _release(self.device, {self._done_word(slot): value})
        return False

    def _done_word(self, slot: int) -> int:
        return self._base + (self.slots + slot) * WORD

    def ready(self, slot: int, value: int) -> "ReadyWait":
        self._check(slot, value)
        wait = ReadyWait(self, self._base + slot * WORD, value)
        with self.lock:
            if len(self._waits) >= 64:  # those that passed say nothing any more
                self._waits = [w for w in self._waits if not w.passed()]
            self._waits.append(wait)
        return wait

    def _check(self, slot: int, value: int) -> None:
        if not 0 <= slot < self.slots or value == 0:
            raise InvalidArgument(f"signal slot {slot} (value {value}) is not one of the "
                                  f"{self.slots} slots this worker registered, or names no call")

    def release(self) -> int:
        """The worker is gone: write every ready word the daemon's copies may still wait
        on (its own stream may never write them), and make later waits pass at once.
        Returns how many were released; their stores are not published."""
        with self.lock:
            self.released = True
            stuck = [w for w in self._waits if not w.passed()]
            self._waits = []
        words: dict[int, int] = {}
        for wait in stuck:
            wait.forced = True
            words[wait.address] = wait.value  # each word's latest wait: values only grow
        _release(self.device, words)
        return len(stuck)


class ReadyWait:
    """The daemon's copies of one call wait, on each stream they use, until the worker
    wrote its ready word (what a torch.cuda.Event's `wait` does for an event)."""

    def __init__(self, signals: DaemonSignals, address: int, value: int) -> None:
        self._signals, self.address, self.value = signals, address, value
        self._passed: list[torch.cuda.Event] = []
        self.forced = False  # released by the daemon, not written by the worker

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        stream = stream or torch.cuda.current_stream(self._signals.device)
        with self._signals.lock:  # release sees this wait, or this wait sees the release
            if self._signals.released:  # the worker is gone: nothing will write the word
                self.forced = True
                return
            wait_value(stream, self.address, self.value)
            passed = torch.cuda.Event()
            passed.record(stream)
            self._passed.append(passed)

    def passed(self) -> bool:
        return all(event.query() for event in self._passed)


class DoneMark:
    """The end of one call's copies: its done word written on the stream that copies
    last (what a torch.cuda.Event's `record` does), or, if no copy recorded it, when the
    call ends (`end`); `query` and `synchronize` ask an event of ours."""

    def __init__(self, signals: DaemonSignals, address: int, value: int) -> None:
        self._device, self.address, self.value = signals.device, address, value
        self._own = torch.cuda.Event()
        self._recorded = False

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        stream = stream or torch.cuda.current_stream(self._device)
        write_value(stream, self.address, self.value)
        self._own.record(stream)
        self._recorded = True

    def end(self) -> None:
        """The call ended: write the word now if no copy of it will (nothing of the call
        is queued any more), before the reply: the worker takes the slot again for a later
        call once its stream is done with this one, and this write must not land after."""
        if not self._recorded:
            _release(self._device, {self.address: self.value})

    def query(self) -> bool:
        return self._own.query()

    def synchronize(self) -> None:
        self._own.synchronize()
