"""Rows on the copy engines (tiercache/copy_engines.py): the addresses each row's copy
gets and which copies join (any machine) and, on a GPU, stores, loads and copies down of
long rows through CudaTransfer, exact, while short rows and slots in device memory stay
with the kernel, and entries of both split between them."""

import numpy as np
import pytest
import torch

from tiercache import copy_engines
from tiercache.copy_engines import MIN_MOVE_BYTES, MIN_ROW_BYTES, joined, row_addresses
from tiercache.tiers.arena import SlabPart

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_each_entry_and_buffer_gets_its_row_its_place_in_the_slot_and_its_size():
    # two buffers: base, row stride, row bytes, offset inside an entry
    table = np.array([[1 << 40, 1 << 41], [64, 256], [32, 128], [0, 32]], np.int64)
    rows, slots = np.array([3, 0, 7]), np.array([9 << 30, 7 << 30, 8 << 30], np.int64)
    worker, slot, sizes = row_addresses(table, rows, slots)
    expected = [(base + r * stride, s + at, width) for r, s in zip(rows.tolist(), slots.tolist())
                for base, stride, width, at in table.T.tolist()]
    assert list(zip(worker.tolist(), slot.tolist(), sizes.tolist())) == expected
    assert worker.dtype == slot.dtype == sizes.dtype == np.uint64


def test_copies_that_go_on_where_the_last_ended_on_both_sides_join_and_no_others():
    def u(*values):
        return np.array(values, np.uint64)
    # 0-2: a run; 3 goes on the destination's side only, 4 goes on from 3 on both;
    # 5 goes on the source's side only, 6 (shorter) from 5 on both
    dsts, srcs, sizes = joined(u(100, 110, 120, 130, 140, 500, 510), u(0, 10, 20, 50, 60, 70, 80),
                               u(10, 10, 10, 10, 10, 10, 5))
    assert list(zip(dsts.tolist(), srcs.tolist(), sizes.tolist())) == [(100, 0, 30), (130, 50, 20),
                                                                        (500, 70, 15)]
    apart = u(300, 100, 200), u(0, 100, 200), u(10, 10, 10)  # in reverse order: none go on
    assert all(np.array_equal(a, b) for a, b in zip(joined(*apart), apart))
    one = u(5), u(6), u(7)
    assert all(np.array_equal(a, b) for a, b in zip(joined(*one), one))


def test_without_a_driver_that_has_them_the_copy_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(copy_engines, "_entry", lambda: None)
    assert not copy_engines.available()
    with pytest.raises(RuntimeError, match="cuMemcpyBatchAsync"):
        copy_engines.copy(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.ones(1, np.uint64), 1)


@pytest.fixture
def engine_calls(monkeypatch):
    """The row counts of the batches queued on the copy engines (the copies still run)."""
    calls, real = [], copy_engines.copy

    def spy(dsts, srcs, sizes, stream):
        calls.append(len(dsts))
        real(dsts, srcs, sizes, stream)
    monkeypatch.setattr(copy_engines, "copy", spy)
    return calls


def random_rows(rows, width, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=gen).cuda()


def host_slab(slots, width):
    from tiercache.tiers.host import HostMemory
    memory = HostMemory(pin=True)
    slab = memory.allocate(slots, width)
    slab.fill_(0xA5)
    return memory, slab


@gpu
@pytest.mark.parametrize("rows", ["long", "short", "mixed"])
def test_rows_reach_host_slots_and_come_back_exactly_on_the_engines_or_the_kernel(engine_calls, rows):
    from tiercache.transfer import MAX_STAGED_ENTRY, CudaTransfer
    assert copy_engines.available()  # drivers of CUDA 12.8 and later
    # long: all rows on the engines; short (in short runs, so not staged): the kernel;
    # mixed, in entries too long to stage: the long rows on the engines, the rest the kernel
    widths = {"long": [MIN_ROW_BYTES, 2 * MIN_ROW_BYTES + 4096], "short": [4096, 12288],
              "mixed": [4096, MAX_STAGED_ENTRY]}[rows]
    source = [random_rows(8, w, seed) for seed, w in enumerate(widths)]
    offsets, entry = [0, widths[0]], sum(widths)
    memory, slab = host_slab(6, entry)
    transfer = CudaTransfer.open(torch.device("cuda"))
    part = SlabPart(slab, np.array([5, 1, 3]), np.arange(3))
    transfer.gather(source, offsets, np.array([7, 2, 0]), [part])
    transfer.fence("store").synchronize()
    for n, s in enumerate((5, 1, 3)):
        for b, at in enumerate(offsets):
            assert torch.equal(slab[s, at:at + widths[b]].cuda(), source[b][[7, 2, 0][n]])
    assert torch.all(slab[[0, 2, 4]] == 0xA5)  # slots nobody stored to stay as they were
    dest = [torch.zeros_like(b) for b in source]
    transfer.scatter([part], dest, offsets, np.array([1, 6, 4]))
    transfer.fence("load").synchronize()
    for n, r in enumerate((1, 6, 4)):
        for b in range(2):
            assert torch.equal(dest[b][r], source[b][[7, 2, 0][n]])
    assert int(dest[0][0].sum()) == 0
    # 3 entries x the buffers on the engines, each way
    assert engine_calls == {"long": [6, 6], "short": [], "mixed": [3, 3]}[rows]
    transfer.close()
    memory.release(slab)


@gpu
def test_slots_in_device_memory_stay_with_the_kernel(engine_calls):
    from tiercache.transfer import CudaTransfer
    source = [random_rows(4, MIN_ROW_BYTES, 3)]
    slab = torch.full((2, MIN_ROW_BYTES), 0xA5, dtype=torch.uint8, device="cuda")
    transfer = CudaTransfer.open(torch.device("cuda"))
    transfer.gather(source, [0], np.array([3, 1]), [SlabPart(slab, np.array([1, 0]), np.arange(2))])
    transfer.fence("store").synchronize()
    assert torch.equal(slab[1], source[0][3]) and torch.equal(slab[0], source[0][1])
    assert engine_calls == []


def going_down(device_entries: int, host_slots: int, targets: list[int], seed: int):
    """For a copy down of entries long enough for the engines: a device slab of random
    entries, a page-locked host slab, a CudaTransfer, and the addresses of host slots
    `targets`."""
    from tiercache.transfer import CudaTransfer
    width = MIN_MOVE_BYTES + 1024
    device_slab = random_rows(device_entries, width, seed)
    memory, host = host_slab(host_slots, width)
    addresses = host.data_ptr() + np.array(targets, np.int64) * host.stride(0)
    return device_slab, memory, host, CudaTransfer.open(torch.device("cuda")), addresses


@gpu
def test_long_entries_go_down_from_device_slots_to_host_slots_on_the_engines(engine_calls):
    # entries shorter than a worker's copies need: moves leave the SMs to the worker
    device_slab, memory, host, transfer, addresses = going_down(3, 4, [2, 0, 3], seed=5)
    transfer.copy_entries([SlabPart(device_slab, np.array([0, 2]), np.array([0, 2]))], addresses)
    transfer.fence("move").synchronize()
    assert torch.equal(host[2].cuda(), device_slab[0]) and torch.equal(host[3].cuda(), device_slab[2])
    assert torch.all(host[[0, 1]] == 0xA5)
    assert engine_calls == [2]
    transfer.close()
    memory.release(host)


@gpu
def test_a_copy_down_of_slots_in_order_is_a_copy_per_run(engine_calls):
    targets = [3, 4, 5, 7]  # device slots 0-2 to host slots 3-5: one run; 4 to 7
    device_slab, memory, host, transfer, addresses = going_down(6, 8, targets, seed=6)
    transfer.copy_entries([SlabPart(device_slab, np.array([0, 1, 2, 4]), np.arange(4))], addresses)
    transfer.fence("move").synchronize()
    for source, target in zip((0, 1, 2, 4), targets):
        assert torch.equal(host[target].cuda(), device_slab[source])
    assert torch.all(host[[0, 1, 2, 6]] == 0xA5)
    assert engine_calls == [2]
    transfer.close()
    memory.release(host)


@gpu
def test_a_batch_the_engines_refuse_is_copied_by_the_kernel_and_the_next_ones_too(monkeypatch, caplog):
    from tiercache.transfer import CudaTransfer
    refused = []

    def refuse(dsts, srcs, sizes, stream):
        refused.append(len(dsts))
        raise copy_engines.CopyEngineError("cuMemcpyBatchAsync of 2 rows failed: CUDA error 801")
    monkeypatch.setattr(copy_engines, "copy", refuse)
    source = [random_rows(4, MIN_ROW_BYTES, 7)]
    memory, slab = host_slab(2, MIN_ROW_BYTES)
    transfer = CudaTransfer.open(torch.device("cuda"))
    part = SlabPart(slab, np.array([1, 0]), np.arange(2))
    for rows in ([3, 1], [0, 2]):
        transfer.gather(source, [0], np.array(rows), [part])
        transfer.fence("store").synchronize()
        assert torch.equal(slab[1].cuda(), source[0][rows[0]]) and torch.equal(slab[0].cuda(), source[0][rows[1]])
    assert refused == [2]  # asked once; the kernel takes long rows from then on
    assert "copy engines refused a batch" in caplog.text
    transfer.close()
    memory.release(slab)


@gpu
def test_a_thread_that_never_used_cuda_copies_down_on_the_engines(caplog):
    # the daemon's background thread: its first CUDA work may be a copy down, which the
    # driver refused (CUDA error 1) while no context was current on the thread
    from concurrent.futures import ThreadPoolExecutor
    device_slab, memory, host, transfer, addresses = going_down(2, 2, [1, 0], seed=8)

    def down() -> None:
        transfer.copy_entries([SlabPart(device_slab, np.array([0, 1]), np.arange(2))], addresses)
        transfer.fence("move").synchronize()
    with ThreadPoolExecutor(1) as fresh:
        fresh.submit(down).result()
    assert torch.equal(host[1].cuda(), device_slab[0]) and torch.equal(host[0].cuda(), device_slab[1])
    assert "refused" not in caplog.text
    transfer.close()
    memory.release(host)
