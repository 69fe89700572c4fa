"""The signal words that order a GPU worker's stream and the daemon's copies, in one
process (both sides over the worker's words; tests/gpu/test_gpu_faults.py kills one of
two real processes). Runs only where there is a GPU."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


class _Mapped:
    """The worker's words as the daemon's side sees them (cuda_ipc.Opened's view; CUDA
    IPC does not open a process's own allocation)."""

    def __init__(self, words: torch.Tensor) -> None:
        self.address, self.device = words.data_ptr(), words.device.index
        self.size = words.numel() * words.element_size()

    def view(self, offset: int, nbytes: int) -> None:
        assert 0 <= offset and offset + nbytes <= self.size


def _sides(slots: int = 4):
    from tiercache.signals import DaemonSignals, WorkerSignals
    worker = WorkerSignals(torch.device("cuda", torch.cuda.current_device()), slots)
    return worker, DaemonSignals(_Mapped(worker.words), 0, worker.exported.nbytes)


@pytest.fixture(autouse=True)
def _loaded():
    """Load every kernel these tests launch before any stream is held: CUDA loads a
    module at its first launch and waits for the device to be idle to do so."""
    for dtype in (torch.float32, torch.int32):
        t = torch.zeros(4, dtype=dtype, device="cuda")
        t.fill_(1)
        bool((t == 1).all().item())
        t.to("cpu")
    torch.cuda._sleep(1)
    torch.cuda.synchronize()


def _blocked(stream: torch.cuda.Stream, seconds: float = 0.3) -> bool:
    time.sleep(seconds)
    return not stream.query()


def test_the_daemons_copies_wait_for_the_ready_word_and_a_released_one_passes():
    worker, daemon = _sides()
    copies = torch.cuda.Stream()
    target = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    from tiercache.signals import wait_value, write_value
    gate = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    held = torch.cuda.Stream()  # the worker's work, which has not yet written the word
    wait_value(held, gate.data_ptr(), 1)  # a word nobody writes until the end
    with torch.cuda.stream(held), worker.call() as call:
        wait = daemon.ready(call.slot, call.value)
        copies.wait_event(wait)  # what Transfer.wait_for does
        with torch.cuda.stream(copies):
            target.fill_(1)
    assert _blocked(copies) and not wait.passed()
    assert daemon.release() == 1 and wait.forced  # the worker is gone
    copies.synchronize()
    assert bool((target == 1).all())
    later = daemon.ready(call.slot, call.value + 1)  # a call still in flight at the release
    copies.wait_event(later)
    copies.synchronize()
    assert later.forced
    write_value(torch.cuda.Stream(), gate.data_ptr(), 1)
    torch.cuda.synchronize()


def test_a_written_ready_word_releases_the_copies_and_nothing_is_forced():
    worker, daemon = _sides()
    copies = torch.cuda.Stream()
    with worker.call() as call:
        copies.wait_event(wait := daemon.ready(call.slot, call.value))
    copies.synchronize()
    assert wait.passed() and daemon.release() == 0 and not wait.forced


def test_a_deferred_ready_word_is_written_at_ready_or_when_the_call_ends():
    worker, daemon = _sides()
    for ended_first in (False, True):
        copies = torch.cuda.Stream()
        with worker.call(deferred=True) as call:
            wait = daemon.ready(call.slot, call.value)
            copies.wait_event(wait)  # the daemon's copies, queued before the word is written
            assert _blocked(copies, 0.1)
            if not ended_first:
                call.ready()
                call.ready()  # once only
                copies.synchronize()
                assert wait.passed()
        copies.synchronize()  # a call that ended without ready(): written on the way out
        assert wait.passed() and not wait.forced
    assert worker.words[:2].tolist() == [1, 2]  # each call's value in its slot's ready word
    assert daemon.release() == 0


def test_the_workers_stream_waits_on_the_done_word_until_written_or_released():
    worker, daemon = _sides()
    copies, mine = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(mine):
        with worker.call() as call:
            copies.wait_event(daemon.ready(call.slot, call.value))
            with torch.cuda.stream(copies):
                torch.cuda._sleep(50_000_000)  # the daemon's copies
            with daemon.call(call.slot, call.value) as (_, done):
                done.record(copies)
            call.await_done()
        seen = torch.zeros(1, device="cuda")
        seen.fill_(1)  # behind the done word
    mine.synchronize()
    assert done.query() and bool(seen.item() == 1)
    assert not worker.waiting()
    with torch.cuda.stream(mine):
        with worker.call() as call:  # the daemon died before it wrote the done word
            call.await_done()
    assert _blocked(mine) and worker.waiting()
    assert worker.release() == 1
    mine.synchronize()
    assert worker.released == 1 and not worker.waiting()


def test_a_slot_is_taken_again_only_once_its_last_call_is_done():
    worker, _ = _sides(slots=2)
    mine = torch.cuda.Stream()
    with torch.cuda.stream(mine):
        with worker.call() as first:
            first.await_done()  # nothing writes it yet
        with worker.call() as second:
            pass
    taken: list[tuple[int, int]] = []
    thread = threading.Thread(target=lambda: taken.append(worker._take()), daemon=True)
    thread.start()
    thread.join(0.5)
    assert not taken  # slot 0's stream still waits; slot 1 is free only behind it on `mine`
    worker.release()
    thread.join(10)
    assert taken and taken[0][1] == second.value + 1
    assert {first.slot, second.slot} == {0, 1}


def test_a_call_without_copies_writes_its_done_word_when_it_ends():
    # a miss, an error, a call that waited for its copies: nothing records the word, so
    # the end of the call writes it (the worker's stream may wait on it)
    worker, daemon = _sides()
    mine = torch.cuda.Stream()
    with torch.cuda.stream(mine), worker.call() as call:
        with daemon.call(call.slot, call.value):
            pass
        call.await_done()
    mine.synchronize()  # not held
    assert not worker.waiting()
    with pytest.raises(RuntimeError), torch.cuda.stream(mine), worker.call() as call:
        with daemon.call(call.slot, call.value):
            raise RuntimeError("the engine failed, with nothing queued")
    call.await_done()
    mine.synchronize()


def test_settling_a_call_that_came_leaves_its_word_to_its_copies():
    from tiercache.signals import own_stream, wait_value, write_value
    worker, daemon = _sides()
    copies, mine = torch.cuda.Stream(), torch.cuda.Stream()
    gate = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(mine), worker.call() as call:
        with daemon.call(call.slot, call.value) as (ready, done):
            copies.wait_event(ready)
            wait_value(copies, gate.data_ptr(), 1)  # copies that cannot finish yet
            done.record(copies)
        call.await_done()  # the reply was lost
    assert daemon.settle(call.slot, call.value)  # but the call came
    assert _blocked(mine) and worker.waiting()  # so the word waits for its copies
    write_value(own_stream(gate.device), gate.data_ptr(), 1)  # not a pooled stream: one may be held
    mine.synchronize()
    assert done.query() and not worker.waiting()


def test_settling_a_call_that_never_came_writes_its_word_and_refuses_it_later():
    from tiercache.errors import FailedPrecondition
    worker, daemon = _sides()
    mine = torch.cuda.Stream()
    with torch.cuda.stream(mine), worker.call() as call:
        call.await_done()  # no reply: the stream waits on the word
    assert _blocked(mine)
    assert not daemon.settle(call.slot, call.value)
    mine.synchronize()
    assert not worker.waiting()
    with pytest.raises(FailedPrecondition, match="settled"):
        with daemon.call(call.slot, call.value):
            pass
    with worker.call() as later:  # later calls of the slot are served as before
        with daemon.call(later.slot, later.value):
            pass


def test_a_thread_that_never_used_cuda_writes_and_waits_on_words():
    # a daemon's lane or background thread may queue a word before any other CUDA work:
    # the driver refused that while no context was current on the thread
    from concurrent.futures import ThreadPoolExecutor
    from tiercache.signals import wait_value, write_value
    words = torch.zeros(2, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()

    def queue() -> None:
        wait_value(stream, words.data_ptr() + 4, 1)
        write_value(stream, words.data_ptr(), 7)
    with ThreadPoolExecutor(1) as fresh:
        fresh.submit(queue).result()
    with ThreadPoolExecutor(1) as fresh:
        fresh.submit(write_value, torch.cuda.Stream(), words.data_ptr() + 4, 1).result()
    stream.synchronize()
    assert words.tolist() == [7, 1]
