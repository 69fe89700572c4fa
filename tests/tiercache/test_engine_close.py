"""A closed engine refuses every call instead of answering from an index whose bytes
are gone."""

from __future__ import annotations

import pytest
import torch

from tiercache.buffers import WorkerBuffers
from tiercache.engine import Engine, EngineConfig
from tiercache.errors import FailedPrecondition
from tiercache.hashing import Namespace, page_keys
from tiercache.layout import Layout
from tiercache.tiers.host import HostConfig


def test_calls_after_close_fail_cleanly():
    pages, state = torch.randn(4, 16), torch.randn(1, 8)
    layout = Layout.of(4, paged={"k": pages}, slots={"s": state})
    buffers = WorkerBuffers.bind(layout, paged={"k": pages}, slots={"s": state})
    keys = page_keys(list(range(8)), Namespace("m", layout.fingerprint).root(), 4)
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 20)))
    engine.store_pages(buffers, keys, [0, 1])
    engine.store_checkpoint(buffers, keys, 0)
    assert engine.match(layout, keys).pages == 2

    # Without a disk tier the host held the only copy: after close nothing may hit.
    engine.close()
    engine.close()  # a second close is harmless
    calls = [lambda: engine.match(layout, keys), lambda: engine.load(buffers, keys, [2, 3], 0),
             lambda: engine.store_pages(buffers, keys, [0, 1]),
             lambda: engine.store_checkpoint(buffers, keys, 0), engine.flush, engine.evict]
    for call in calls:
        with pytest.raises(FailedPrecondition, match="closed"):
            call()
