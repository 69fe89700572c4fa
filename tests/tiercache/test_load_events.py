"""An asynchronous load keeps its entries pinned until its copies are done, and asks
whether they are done of an event of its own: the event it hands the worker is the
worker's to open and, in CUDA, to record too, which would make a copy in flight look
done (its slots unpinned, evicted and written by another store while still being read).

A transfer whose events say what the test wants stands in for the GPU (which cannot
be made to complete one event and not the other at will): the copies themselves are the
CPU path's."""

from __future__ import annotations

import numpy as np

from drills.worlds import prompt_keys, random_buffers
from tiercache.engine import Engine, EngineConfig
from tiercache.hashing import key_array
from tiercache.layout import BufferSpec, Layout
from tiercache.results import Kind
from tiercache.tiers.host import HostConfig
from tiercache.transfer import CpuTransfer

LAYOUT = Layout(16, paged=(BufferSpec("kv", 32, (16, 8), "bfloat16"),))


class Mark:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class MarkedTransfer(CpuTransfer):
    """The CPU's copies, with every fence a Mark the test completes by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[Mark] = []

    def fence(self, direction: str, interprocess: bool = False, into=None) -> Mark:
        self.marks.append(into if into is not None else Mark())
        return self.marks[-1]


def test_the_event_handed_to_the_worker_does_not_unpin_a_load_in_flight():
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 22, pin=False)))
    source, dest = random_buffers(LAYOUT, seed=1), random_buffers(LAYOUT, seed=2)
    keys = prompt_keys(LAYOUT, seed=1, pages=6)
    engine.store(source, keys, range(6))
    rows = engine.books.rows_of(Kind.PAGE, key_array(keys))
    transfer = MarkedTransfer()
    result = engine.loads.load(dest, key_array(keys), range(10, 16), None, transfer, None,
                               asynchronous=True, checks=None)
    assert result.done is transfer.marks[0] and len(transfer.marks) == 2
    result.done.done = True  # the worker recorded the event it was handed: done at once
    engine.loads.reap()
    assert engine.index.column("pins", rows).tolist() == [1] * 6  # the copies still run
    transfer.marks[1].done = True  # the daemon's own mark: the copies are done
    engine.loads.reap()
    assert engine.index.column("pins", rows).tolist() == [0] * 6
    engine.close()


def test_a_load_records_its_end_into_the_event_it_is_given():
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 22, pin=False)))
    source, dest = random_buffers(LAYOUT, seed=3), random_buffers(LAYOUT, seed=4)
    keys = prompt_keys(LAYOUT, seed=3, pages=4)
    engine.store(source, keys, range(4))
    transfer, given = MarkedTransfer(), Mark()
    for _ in range(2):  # the same event, recorded again by each load
        result = engine.loads.load(dest, key_array(keys), range(10, 14), None, transfer, None,
                                   asynchronous=True, checks=None, done_event=given)
        assert result.done is given
    assert np.array_equal(dest.paged[0][10:14], source.paged[0][:4])
    engine.close()
