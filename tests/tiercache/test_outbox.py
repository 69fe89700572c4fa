"""The outbox's parts that need no GPU: its layout, its buffers, and what a worker without
one gets from `post`. The copies in and the ordering on the stream run on a GPU only
(tests/gpu/test_gpu.py, `posted`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.service.daemon import running_daemon
from tiercache.client import Client, EmbeddedClient
from tiercache.engine import EngineConfig
from tiercache.tiers.host import HostConfig
from tiercache.errors import InvalidArgument
from tiercache.layout import BufferSpec, Layout
from tiercache.buffers import device_buffers
from tiercache.outbox import outbox_layout

LAYOUT = Layout(16, paged=(BufferSpec("k", 64, (8, 128), "bfloat16"), BufferSpec("mla", 64, (72,), "bfloat16")),
                slots=(BufferSpec("recurrent", 4, (4, 32, 32), "float32"), BufferSpec("conv", 4, (256, 3), "bfloat16")))


def test_an_outbox_shares_the_workers_namespace_with_its_own_row_counts():
    boxed = outbox_layout(LAYOUT, pages=10, checkpoints=2)
    assert boxed.fingerprint == LAYOUT.fingerprint
    assert (boxed.page_rows, boxed.slot_rows) == (10, 2)
    assert [(b.name, b.row_shape, b.dtype) for b in boxed.paged + boxed.slots] == [
        (b.name, b.row_shape, b.dtype) for b in LAYOUT.paged + LAYOUT.slots]


@pytest.mark.parametrize("pages, checkpoints", [(0, 1), (4, 0), (-1, 1)])
def test_an_outbox_without_room_for_a_page_or_a_checkpoint_is_refused(pages, checkpoints):
    with pytest.raises(InvalidArgument, match="at least one page"):
        outbox_layout(LAYOUT, pages, checkpoints)


def test_a_layout_without_state_buffers_needs_no_checkpoint():
    paged_only = Layout(16, paged=LAYOUT.paged)
    assert outbox_layout(paged_only, pages=3, checkpoints=0).slot_rows == 0


def test_the_outbox_buffers_are_aligned_views_of_one_allocation_that_never_overlap():
    boxed = outbox_layout(LAYOUT, pages=5, checkpoints=3)
    buffers = device_buffers(boxed, torch.device("cpu"))
    spans = []
    for b in (*boxed.paged, *boxed.slots):
        t = buffers[b.name]
        assert tuple(t.shape) == b.shape and str(t.dtype) == f"torch.{b.dtype}" and t.is_contiguous()
        assert t.data_ptr() % 16 == 0
        spans.append((t.data_ptr(), t.data_ptr() + b.rows * b.row_bytes))
    base = min(start for start, _ in spans)
    assert all((start - base) % 512 == 0 for start, _ in spans)
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    storages = {t.untyped_storage().data_ptr() for t in buffers.values()}
    assert len(storages) == 1


def test_post_without_an_outbox_stores_as_store_does_and_hands_back_a_done_future():
    prompt = np.random.default_rng(3).integers(0, 50_000, 4 * 16).tolist()
    client = EmbeddedClient(EngineConfig(host=HostConfig(budget_bytes=16 << 20, pin=False)))
    worker = client.register("m", LAYOUT)
    for t in (*worker.paged.values(), *worker.slots.values()):
        t.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),),
                                                          dtype=torch.uint8))
    future = worker.post(prompt, kv_rows=range(4), checkpoints={64: 1})
    assert future.done() and future.result().stored == 5
    assert worker.match(prompt).pages == 4
    client.close()


def test_a_daemon_worker_with_cpu_buffers_is_told_an_outbox_is_for_gpu_workers(tmp_path):
    with running_daemon(tmp_path) as (address, _):
        client = Client(address)
        with pytest.raises(InvalidArgument, match="outbox is for a GPU worker"):
            client.register("m", LAYOUT, outbox_pages=4)
        worker = client.register("m", LAYOUT)  # shared memory: post is a store
        prompt = np.random.default_rng(4).integers(0, 50_000, 2 * 16).tolist()
        assert worker.post(prompt, kv_rows=[5, 9], checkpoints={32: 2}).result().stored == 3
        assert worker.match(prompt).pages == 2
        with pytest.raises(InvalidArgument):  # bad input raises at once, as store's does
            worker.post(prompt, kv_rows=[5, 9], checkpoints={31: 2})
        worker.close()
        client.close()
