"""The words a lane is published and waited on by (tiercache/_lane.c), between two real
processes sharing a memfd: a waiter in one wakes when the other publishes, and not before."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tiercache import shm
from tiercache._lane import load, publish, wait

WAITER = """
import mmap, os, sys, time
from tiercache._lane import wait
mapping = mmap.mmap(int(sys.argv[1]), 4096)
print("waiting", flush=True)
start = time.monotonic()
seen = wait(mapping, 64, 0, 10.0, 0.0)
print(seen, round(time.monotonic() - start, 3), flush=True)
"""


def test_a_word_published_in_one_process_wakes_a_waiter_in_another():
    fd, mapping = shm.sealed(4096, "lane-words")
    try:
        waiter = subprocess.Popen([sys.executable, "-c", WAITER, str(fd)], pass_fds=(fd,),
                                  stdout=subprocess.PIPE, text=True)
        assert waiter.stdout.readline() == "waiting\n"
        time.sleep(0.3)  # asleep in the kernel by now: only the wake brings it back
        assert waiter.poll() is None
        publish(mapping, 64, 42)
        seen, waited = waiter.stdout.readline().split()
        assert waiter.wait(10) == 0
    finally:
        os.close(fd)
    assert seen == "42" and 0.3 <= float(waited) < 5  # woken, not timed out
    assert load(mapping, 64) == 42 and load(mapping, 0) == 0


def test_a_wait_ends_with_the_old_value_at_its_timeout_and_at_once_for_another():
    word = bytearray(8)
    start = time.monotonic()
    assert wait(word, 0, 0, 0.05, 0.01) == 0
    assert 0.05 <= time.monotonic() - start < 1
    for timeout in (float("nan"), -1.0, 0.0):  # no time: a look, no wait
        assert wait(word, 0, 0, timeout, 0.0) == 0
    publish(word, 4, 9)
    assert wait(word, 4, 0, 10.0, 0.0) == 9  # another value than the one waited past


@pytest.mark.parametrize("offset", [-4, 2, 8, 1 << 40])
def test_a_word_outside_the_buffer_or_unaligned_is_refused(offset):
    for call in (lambda: load(bytearray(8), offset), lambda: publish(bytearray(8), offset, 1),
                 lambda: wait(bytearray(8), offset, 0, 0.0, 0.0)):
        with pytest.raises(ValueError, match="no aligned 32-bit word"):
            call()
