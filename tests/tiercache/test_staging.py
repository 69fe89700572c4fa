"""Short rows between worker buffers and host slots staged through a ring of device
memory (transfer.py): runs of slots found on any machine; on a GPU, stores and loads
through the ring, exact over several turns of it and from two threads at once, while
scattered slots and what the engines refuse part way stay with the kernel."""

import threading

import numpy as np
import pytest
import torch

from tests.tiercache.test_copy_engines import engine_calls  # noqa: F401 (a fixture)
from tiercache import copy_engines, transfer
from tiercache.tiers.arena import SlabPart
from tiercache.transfer import _pieces

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ENTRY = 16 * 1024  # rows of 4 KiB and 12 KiB


def test_pieces_are_runs_of_one_slab_cut_where_a_half_of_the_ring_ends():
    stride = 64
    addresses = np.array([0, 64, 128, 512, 576, 1024, 2048, 2112, 2176, 2240], np.int64)
    slabs = np.array([0, 0, 0, 0, 0, 0, 0, 0, 1, 1])  # a second slab right behind the first
    starts, lengths, runs = _pieces(addresses, stride, slabs, per_half=100)
    assert starts.tolist() == [0, 3, 5, 6, 8] and lengths.tolist() == [3, 2, 1, 2, 2] and runs == 5
    starts, lengths, runs = _pieces(addresses, stride, slabs, per_half=4)  # halves of 4 slots
    assert starts.tolist() == [0, 3, 4, 5, 6, 8] and lengths.tolist() == [3, 1, 1, 1, 2, 2] and runs == 5
    starts, lengths, runs = _pieces(np.array([4096], np.int64), stride, np.zeros(1), per_half=4)
    assert starts.tolist() == [0] and lengths.tolist() == [1] and runs == 1
    starts, lengths, runs = _pieces(addresses[:3], stride, None, per_half=2)  # one slab
    assert starts.tolist() == [0, 2] and lengths.tolist() == [2, 1] and runs == 1
    assert _pieces(addresses[::-1].copy(), stride, None, per_half=4) is None  # to be sorted first


@pytest.fixture
def small_ring(monkeypatch):
    """A ring of 1 MiB halves, so that a few hundred 16 KiB entries turn it several times,
    and runs of 64 KiB count as long."""
    monkeypatch.setattr(transfer, "STAGE_BYTES", 1 << 20)
    monkeypatch.setattr(transfer, "MAX_STAGED_ENTRY", 1 << 18)
    monkeypatch.setattr(transfer, "MIN_RUN_BYTES", 64 * 1024)


def worker_buffers(rows, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (rows, w), dtype=torch.uint8, generator=gen).cuda()
            for w in (4096, ENTRY - 4096)]


def host_slabs(count, slots):
    from tiercache.tiers.host import HostMemory
    memory = HostMemory(pin=True)
    slabs = [memory.allocate(slots, ENTRY) for _ in range(count)]
    for slab in slabs:
        slab.fill_(0xA5)
    return memory, slabs


def expect_entries(slab, slots, buffers, rows):
    for s, r in zip(slots, rows):
        assert torch.equal(slab[s, :4096].cuda(), buffers[0][r])
        assert torch.equal(slab[s, 4096:].cuda(), buffers[1][r])


def store_and_load_back(cuda, source, slab, part, rows):
    """Store `rows` into the part's slots (positions in order), then load them into the
    same rows of fresh buffers: both exact."""
    cuda.gather(source, [0, 4096], rows, [part])
    cuda.fence("store").synchronize()
    expect_entries(slab, part.local, source, rows)
    dest = [torch.zeros_like(b) for b in source]
    cuda.scatter([part], dest, [0, 4096], rows)
    cuda.fence("load").synchronize()
    assert all(torch.equal(d[rows], s[rows]) for d, s in zip(dest, source))


@gpu
def test_runs_of_slots_go_through_the_ring_and_come_back_exactly(small_ring, engine_calls):
    from tiercache.transfer import CudaTransfer
    source = worker_buffers(400, 1)
    memory, (first, second) = host_slabs(2, 160)
    # 150 entries in two runs of the first slab (one across the end of a ring half, 64
    # entries a half) and 120 in one run of the second: three parts, one store
    slots_a = np.r_[np.arange(0, 100), np.arange(110, 160)]
    slots_b = np.arange(20, 140)
    rows = np.random.default_rng(0).permutation(400)[:270]
    parts = [SlabPart(first, slots_a[::-1].copy(), np.arange(150)),
             SlabPart(second, slots_b, np.arange(150, 270))]
    cuda = CudaTransfer.open(torch.device("cuda"))
    cuda.gather(source, [0, 4096], rows, parts)
    cuda.fence("store").synchronize()  # the fence covers the copies out of the ring
    expect_entries(first, slots_a[::-1], source, rows[:150])
    expect_entries(second, slots_b, source, rows[150:])
    assert torch.all(first[100:110] == 0xA5) and torch.all(second[:20] == 0xA5)
    # 270 entries, 64 a half: five turns, each one batch of the runs in its half; two
    # halves hold the end of one run and the start of the next (which two depends on
    # where the slabs lie), the others one piece
    assert len(engine_calls) == 5 and sum(engine_calls) == 7
    dest = [torch.zeros_like(b) for b in source]
    back = np.random.default_rng(1).permutation(400)[:270]
    cuda.scatter(parts, dest, [0, 4096], back)
    cuda.fence("load").synchronize()
    for b in range(2):
        assert torch.equal(dest[b][torch.from_numpy(back).cuda()], source[b][torch.from_numpy(rows).cuda()])
    assert len(engine_calls) == 10 and sum(engine_calls) == 14  # the same pieces back
    cuda.close()
    for slab in (first, second):
        memory.release(slab)


@gpu
def test_scattered_slots_stay_with_the_kernel(small_ring, engine_calls):
    from tiercache.transfer import CudaTransfer
    source = worker_buffers(64, 2)
    memory, (slab,) = host_slabs(1, 64)
    slots = np.arange(0, 64, 2)  # no two consecutive: runs of one 16 KiB entry
    part = SlabPart(slab, slots, np.arange(32))
    cuda = CudaTransfer.open(torch.device("cuda"))
    cuda.gather(source, [0, 4096], np.arange(32), [part])
    cuda.fence("store").synchronize()
    dest = [torch.zeros_like(b) for b in source]
    cuda.scatter([part], dest, [0, 4096], np.arange(32, 64))
    cuda.fence("load").synchronize()
    assert all(torch.equal(d[32:], s[:32]) for d, s in zip(dest, source))
    assert engine_calls == []
    cuda.close()
    memory.release(slab)


@gpu
@pytest.mark.parametrize("kept", [8192, 100])  # rows up into the ring's memory, or their own
def test_stores_queued_back_to_back_each_copy_their_own_rows(small_ring, monkeypatch, kept):
    """The second store's rows go up while the first's launches may still wait to read
    theirs: each store copies its own rows."""
    from tiercache.transfer import CudaTransfer
    monkeypatch.setattr(transfer, "ROWS_KEPT", kept)
    source = worker_buffers(600, 6)
    memory, (slab,) = host_slabs(1, 400)
    order = np.random.default_rng(4).permutation(600)
    first, second = order[:200], order[200:400]
    cuda = CudaTransfer.open(torch.device("cuda"))
    torch.cuda._sleep(50_000_000)  # the GPU busy a while: both stores queued before it copies
    cuda.wait_for(torch.cuda.current_stream().record_event(), "store")
    cuda.gather(source, [0, 4096], first, [SlabPart(slab, np.arange(200), np.arange(200))])
    cuda.gather(source, [0, 4096], second, [SlabPart(slab, np.arange(200, 400), np.arange(200))])
    cuda.fence("store").synchronize()
    expect_entries(slab, range(200), source, first)
    expect_entries(slab, range(200, 400), source, second)
    cuda.close()
    memory.release(slab)


@gpu
@pytest.mark.parametrize("kept", [8192, 100])
def test_two_threads_through_one_ring_each_get_their_own_bytes(small_ring, monkeypatch, kept):
    from tiercache.transfer import CudaTransfer
    monkeypatch.setattr(transfer, "ROWS_KEPT", kept)
    source = worker_buffers(600, 3)
    memory, (slab,) = host_slabs(1, 600)
    cuda = CudaTransfer.open(torch.device("cuda"))
    dest = [torch.zeros_like(b) for b in source]
    failures = []

    def store_and_load(first):  # each thread 300 entries, 20 times, its own slots and rows
        part = SlabPart(slab, np.arange(first, first + 300), np.arange(300))
        try:
            for _ in range(20):
                cuda.gather(source, [0, 4096], np.arange(first, first + 300), [part])
                cuda.fence("store").synchronize()
                cuda.scatter([part], dest, [0, 4096], np.arange(first, first + 300))
                cuda.fence("load").synchronize()
        except BaseException as error:  # pragma: no cover - reported below
            failures.append(error)
    threads = [threading.Thread(target=store_and_load, args=(first,)) for first in (0, 300)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert all(torch.equal(d, s) for d, s in zip(dest, source))
    cuda.close()
    memory.release(slab)


@gpu
def test_a_staged_batch_the_engines_refuse_part_way_is_finished_by_the_kernel(small_ring, monkeypatch,
                                                                             caplog):
    from tiercache.transfer import CudaTransfer
    real, calls = copy_engines.copy, []

    def second_refused(dsts, srcs, sizes, stream):
        calls.append(len(dsts))
        if len(calls) == 2:
            raise copy_engines.CopyEngineError("cuMemcpyBatchAsync of 1 rows failed: CUDA error 801")
        real(dsts, srcs, sizes, stream)
    monkeypatch.setattr(copy_engines, "copy", second_refused)
    source = worker_buffers(300, 4)
    memory, (slab,) = host_slabs(1, 200)
    rows = np.random.default_rng(2).permutation(300)[:200]
    cuda = CudaTransfer.open(torch.device("cuda"))
    part = SlabPart(slab, np.arange(200), np.arange(200))
    # 200 entries, 64 a half: the store's second turn is refused, and the engines asked no more
    store_and_load_back(cuda, source, slab, part, rows)
    assert calls == [1, 1]
    assert "copy engines refused a batch" in caplog.text
    cuda.close()
    memory.release(slab)


@gpu
def test_without_room_for_the_ring_the_launch_copies_and_says_so(small_ring, engine_calls, monkeypatch,
                                                                caplog):
    from tiercache.transfer import CudaTransfer, _Ring

    def no_room(self, device):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test)")
    monkeypatch.setattr(_Ring, "__init__", no_room)
    source = worker_buffers(300, 5)
    memory, (slab,) = host_slabs(1, 200)
    rows = np.random.default_rng(3).permutation(300)[:200]
    part = SlabPart(slab, np.arange(200), np.arange(200))
    cuda = CudaTransfer.open(torch.device("cuda"))
    for _ in range(2):  # asked once, said once
        store_and_load_back(cuda, source, slab, part, rows)
    assert engine_calls == []
    assert caplog.text.count("no room on") == 2  # one line per direction
    cuda.close()
    memory.release(slab)
