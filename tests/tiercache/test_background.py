import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from tiercache import background as background_module
from tiercache.background import Background, Runner
from tiercache.policy import WriteConfig


def test_drain_returns_once_the_work_of_every_kick_is_done():
    work = [3]  # three units of work

    def step():
        if not work[0]:
            return False
        work[0] -= 1
        return True
    background = Runner(step, "test-background")
    background.start()
    # 1. a kick runs the step until it reports no work left; the barrier waits for that
    background.kick()
    background.drain()
    assert work == [0]
    # 2. more work, another kick, another barrier
    work[0] = 2
    background.kick()
    background.drain()
    assert work == [0]
    background.stop()
    assert not background.running


def test_an_error_in_a_step_surfaces_at_the_barrier_once_and_the_thread_lives_on():
    calls = []

    def step():
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise OSError("disk gone")
        return False
    background = Runner(step, "test-background")
    background.start()
    background.kick()
    with pytest.raises(OSError, match="disk gone"):
        background.drain()
    background.kick()
    background.drain()  # the error was reported once; the next kick works
    assert calls == ["test-background"] * 2 and background.running
    background.stop()


def test_a_timed_kick_runs_the_step_by_itself_at_its_time_and_not_before():
    ran: list[float] = []

    def step():
        ran.append(time.monotonic())
        return False
    runner = Runner(step, "test-background")
    runner.start()
    due = time.monotonic() + 1.0
    runner.kick_at(due + 1.0)
    runner.kick_at(due)  # the earlier of two wins
    runner.drain()  # a barrier waits for kicks, not for kicks still to come
    assert ran == []
    deadline = time.monotonic() + 5
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ran) == 1 and ran[0] >= due
    runner.kick()  # a plain kick runs at once
    runner.drain()
    assert len(ran) == 2
    runner.stop()


class _Books:
    """What Background asks of the books for a copy down, and when it was asked."""

    disk = None
    device = object()

    def __init__(self) -> None:
        self.copied: list[tuple[float, list[int]]] = []

    def begin_copy_down(self, rows):
        return SimpleNamespace(rows=rows)

    def end_copy_down(self, batch, copied):
        self.copied.append((time.monotonic(), batch.rows.tolist()))


def test_copies_down_wait_their_delay_each_and_a_drain_does_them_at_once(monkeypatch):
    monkeypatch.setattr(background_module, "COPY_DOWN_DELAY", 1.0)
    books = _Books()
    mover = SimpleNamespace(copy_down=lambda batch: None)
    background = Background(books, mover, WriteConfig(), promote=lambda: False)
    background.start()
    # 1. two stores' entries, a little apart: each is copied down once its delay is over,
    # the later one too (each copy down sets the time of the next)
    first = time.monotonic()
    background.stored_on_device(np.array([1, 2]))
    time.sleep(0.05)
    second = time.monotonic()
    background.stored_on_device(np.array([3]))
    assert books.copied == []  # right after the stores: not yet
    deadline = time.monotonic() + 5
    while len(books.copied) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [rows for _, rows in books.copied] == [[1, 2], [3]]
    assert books.copied[0][0] >= first + 1.0 and books.copied[1][0] >= second + 1.0
    # 2. a drain (a flush, an eviction from the device, the daemon stopping) does not wait
    background.stored_on_device(np.array([4]))
    started = time.monotonic()
    background.drain()
    assert books.copied[-1][1] == [4] and books.copied[-1][0] - started < 1.0
    # 3. nor does stopping
    background.stored_on_device(np.array([5]))
    background.stop()
    assert books.copied[-1][1] == [5]


def test_copies_down_go_at_once_from_the_first_call_of_a_worker_away_from_the_device(monkeypatch):
    # a worker on the CPU or another GPU reads device entries from their host copies: the
    # deferred ones go now, and later ones as soon as their store published them
    monkeypatch.setattr(background_module, "COPY_DOWN_DELAY", 30.0)
    books = _Books()
    background = Background(books, SimpleNamespace(copy_down=lambda batch: None), WriteConfig(),
                            promote=lambda: False)
    background.start()
    background.stored_on_device(np.array([1]))
    background.copy_down_at_once()
    background.stored_on_device(np.array([2]))
    deadline = time.monotonic() + 10
    while len(books.copied) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [rows for _, rows in books.copied] == [[1], [2]]
    background.stop()
