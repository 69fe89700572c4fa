import threading

import pytest

from tiercache.background import Runner


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
