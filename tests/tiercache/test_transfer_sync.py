"""CudaTransfer.synchronize names the copy streams that keep it waiting (the hang of a
daemon whose copies wait for a dead worker: README, Failures). Stand-in streams, so it
runs without a GPU; the real streams are waited on the same way on the GPU machine."""

from __future__ import annotations

import logging
import time

from tiercache import transfer
from tiercache.transfer import CudaTransfer


class _Stream:
    def __init__(self, busy_for: float) -> None:
        self.until = time.monotonic() + busy_for

    def query(self) -> bool:
        return time.monotonic() >= self.until

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.until - time.monotonic()))


def _transfer(**busy_for: float) -> CudaTransfer:
    cuda = object.__new__(CudaTransfer)
    cuda.device, cuda._streams = "cuda:0", {name: _Stream(s) for name, s in busy_for.items()}
    return cuda


def test_a_slow_wait_names_the_streams_still_copying_once(monkeypatch, caplog):
    monkeypatch.setattr(transfer, "SLOW_SYNC", 0.05)
    cuda = _transfer(load=0.0, store=0.3, move=0.4)
    with caplog.at_level(logging.WARNING, logger="tiercache"):
        cuda.synchronize()
    said = [r.getMessage() for r in caplog.records if "copy streams" in r.getMessage()]
    assert len(said) == 1 and "['store', 'move']" in said[0], said
    assert all(s.query() for s in cuda._streams.values())


def test_a_quick_wait_says_nothing(monkeypatch, caplog):
    monkeypatch.setattr(transfer, "SLOW_SYNC", 5.0)
    with caplog.at_level(logging.WARNING, logger="tiercache"):
        _transfer(load=0.02, store=0.0).synchronize()
    assert not [r for r in caplog.records if "copy streams" in r.getMessage()]
