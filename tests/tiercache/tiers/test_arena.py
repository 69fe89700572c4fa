import numpy as np
import torch

from tiercache.tiers.arena import SlotArena
from tiercache.tiers.host import HostConfig, HostMemory, host_arena


def arena(budget, slab):
    return SlotArena(budget, slab, HostMemory(pin=False))


def test_slots_come_from_slabs_within_the_budget():
    a = arena(budget=1000, slab=400)
    slots = a.alloc(100, 20)
    # 400-byte slabs of four 100-byte slots; the budget allows two and a half slabs
    assert slots == list(range(10)) and a.used_bytes == 1000 and a.reserved_bytes == 1000
    assert a.alloc(100, 1) == []


def test_freed_slots_are_reused_before_new_memory():
    a = arena(budget=1000, slab=400)
    slots = a.alloc(100, 8)
    a.free(100, [slots[5], slots[2]])
    assert sorted(a.alloc(100, 2)) == [2, 5] and a.reserved_bytes == 800


def test_empty_slabs_move_to_another_entry_size():
    a = arena(budget=800, slab=400)
    small = a.alloc(100, 8)  # both slabs go to 100-byte slots
    assert a.alloc(400, 1) == []
    a.free(100, small[4:])  # the second slab empties
    assert a.alloc(400, 1) == [0] and a.reserved_bytes == 800


def test_slot_views_are_rows_of_a_slab_and_parts_split_by_slab():
    a = arena(budget=1000, slab=300)
    slots = np.array(a.alloc(100, 6))
    for s in slots:
        a.pool(100).view(int(s)).fill_(int(s))
    parts = list(a.pool(100).parts(slots[::-1].copy()))
    assert [list(p.local) for p in parts] == [[2, 1, 0], [2, 1, 0]]
    assert [list(p.positions) for p in parts] == [[3, 4, 5], [0, 1, 2]]
    assert torch.equal(parts[1].slab[:, 0], torch.tensor([3, 4, 5], dtype=torch.uint8))


def test_parts_cover_any_slot_list_once_by_slab_in_ascending_order():
    a = arena(budget=7000, slab=700)  # ten slabs of seven 100-byte slots
    pool = a.pool(100)
    everything = np.array(a.alloc(100, 70))
    for s in everything:
        pool.view(int(s))[0] = int(s)
    rng = np.random.default_rng(0)
    for trial in range(500):
        slots = rng.choice(everything, int(rng.integers(1, 40)), replace=False)
        if trial % 2:  # in slab order, the usual case, and shuffled
            slots = np.sort(slots)
        parts = list(pool.parts(slots))
        firsts = [int(p.slab[p.local[0], 0]) // 7 for p in parts]
        assert firsts == sorted(set(firsts))  # one part a slab, ascending
        positions = np.concatenate([p.positions for p in parts])
        assert sorted(positions.tolist()) == list(range(len(slots)))
        for p in parts:
            assert np.all(np.diff(p.positions) > 0)  # the caller's order within a slab
            assert p.slab[p.local, 0].tolist() == slots[p.positions].tolist()


def test_host_arena_uses_plain_memory_without_cuda():
    a = host_arena(HostConfig(budget_bytes=1 << 20, slab_bytes=1 << 16, pin=False))
    slot = a.alloc(4096, 1)[0]
    assert not a.pool(4096).view(slot).is_pinned()
    a.close()
    assert a.reserved_bytes == 0
