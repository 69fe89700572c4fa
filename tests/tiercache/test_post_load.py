"""What `Worker.post_load` gives where no signal words order the daemon with a stream: a
CPU worker through a daemon and the embedded engine load as `load` does, the result or
the error in a future that is done. The posted path proper (a GPU worker's stream made to
wait before the reply) runs on a GPU only (tests/gpu/test_gpu.py, `post_load`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.service.daemon import running_daemon
from tiercache.client import Client, EmbeddedClient
from tiercache.engine import EngineConfig
from tiercache.errors import InvalidArgument
from tiercache.layout import BufferSpec, Layout
from tiercache.tiers.host import HostConfig

LAYOUT = Layout(16, paged=(BufferSpec("k", 16, (8, 64), "bfloat16"),),
                slots=(BufferSpec("state", 4, (4, 32), "float32"),))
PROMPT = np.random.default_rng(5).integers(0, 50_000, 4 * 16).tolist()


def _posted_loads(worker) -> None:
    for t in (*worker.paged.values(), *worker.slots.values()):
        t.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),),
                                                          dtype=torch.uint8))
    worker.store(PROMPT, kv_rows=range(4), checkpoints={64: 0})
    future = worker.post_load(PROMPT, kv_rows=range(8, 12), slot=2)
    assert future.done() and future.result().match.pages == 4
    k, state = worker.paged["k"].view(torch.int16), worker.slots["state"].view(torch.int32)
    assert torch.equal(k[8:12], k[:4]) and torch.equal(state[2], state[0])  # bits: random bytes hold NaNs
    assert worker.post_load(PROMPT[::-1], kv_rows=range(8, 12), slot=2).result().match.pages == 0
    refused = worker.post_load(PROMPT, kv_rows=range(8, 12), slot=9)  # no such state slot
    assert refused.done() and isinstance(refused.exception(), InvalidArgument)
    with pytest.raises(InvalidArgument):  # bad arguments of the worker's own are raised at once
        worker.post_load(kv_rows=range(4))


def test_a_cpu_worker_through_a_daemon_posts_a_load_that_is_done_when_it_returns(tmp_path):
    with running_daemon(tmp_path) as (address, _):
        client = Client(address)
        _posted_loads(client.register("m", LAYOUT))
        client.close()


def test_the_embedded_engine_posts_a_load_that_is_done_when_it_returns():
    client = EmbeddedClient(EngineConfig(host=HostConfig(budget_bytes=16 << 20, pin=False)))
    _posted_loads(client.register("m", LAYOUT))
    client.close()
