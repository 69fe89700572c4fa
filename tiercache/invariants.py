"""The engine's books, checked against themselves (SGLang's `sanity_check` in spirit).

`violations(engine)` drains the background work, then, under the engine's lock, checks
what must hold whenever no call is in flight:

- every index row in use maps from its own key (the key it was published under), and
  the key maps hold no other key: no key names a freed or foreign row;
- the free rows are distinct and in use by no entry;
- per tier, the entry counts and byte totals the index keeps equal its rows;
- every entry in a memory tier has a slot of its own, in a live slab, not on a free
  list; the arena's bytes in use are exactly its entries' (each slot charged its stride);
- nothing is pinned (no load, promotion or disk write is in flight);
- the disk tier's bytes are its entries'.

Tests call it after each step of an engine scenario; the fuzzer and drills after each
call. It returns what is wrong as sentences (empty when the books balance).
"""

from __future__ import annotations

import numpy as np

from tiercache.engine import Engine
from tiercache.index import Index
from tiercache.results import ARENA_TIERS, TIERS, Kind, Tier
from tiercache.tiers.arena import SlotArena


def violations(engine: Engine) -> list[str]:
    engine.stores.publishing.settle()  # stores that replied before their copies were done
    engine.background.drain()
    if engine.remote is not None:  # its writer pins what it reads, like the disk writer
        engine.remote.drain()
    engine.loads.reap()
    books = engine.books
    with books.lock:  # the checker reads the books whole, as no path may
        index, found = books.index, []
        found += _keys(index)
        found += _tiers(index)
        for tier in ARENA_TIERS:
            arena = books.device if tier == Tier.DEVICE else books.host
            if arena is not None:
                found += _slots(index, tier, arena)
        if books.disk is not None:
            disk_bytes = index.bytes[Tier.DISK]
            if books.disk.used_bytes != disk_bytes:
                found.append(f"the disk tier counts {books.disk.used_bytes} bytes, its entries "
                             f"hold {disk_bytes}")
        live = _live(index)
        pinned = live[index.column("pins", live) > 0]
        if len(pinned):
            found.append(f"{len(pinned)} entries stay pinned with no load in flight")
        return found


def _live(index: Index) -> np.ndarray:
    return np.flatnonzero(index._cols["tiers"][:index._capacity] != 0)


def _keys(index: Index) -> list[str]:
    found, live = [], _live(index)
    kinds = index.column("kind", live)
    for kind in Kind:
        rows = live[kinds == kind]
        mapped = index.rows_of(kind, index.keys(rows))
        wrong = rows[mapped != rows]
        if len(wrong):
            found.append(f"{len(wrong)} {kind.name.lower()} rows are not where their key points "
                         f"(row {int(wrong[0])} -> {int(mapped[mapped != rows][0])})")
        if len(index._maps[kind]) != len(rows):
            found.append(f"the {kind.name.lower()} key map holds {len(index._maps[kind])} keys for "
                         f"{len(rows)} entries")
    free = index.free_rows
    if len(np.unique(free)) != len(free):
        found.append("a row is on the free list twice")
    if np.isin(free, live).any():
        found.append("a row in use is on the free list")
    return found


def _tiers(index: Index) -> list[str]:
    found = []
    for tier in TIERS:
        rows = index.rows_in(tier)
        nbytes = int(index.column("nbytes", rows).sum())
        if index.count[tier] != len(rows) or index.bytes[tier] != nbytes:
            found.append(f"{tier.name}: the index counts {index.count[tier]} entries and "
                         f"{index.bytes[tier]} bytes, its rows say {len(rows)} and {nbytes}")
    return found


def _slots(index: Index, tier: Tier, arena: SlotArena) -> list[str]:
    found, rows, charged = [], index.rows_in(tier), 0
    sizes, slots = index.column("nbytes", rows), index.slots(rows, tier)
    for size in np.unique(sizes).tolist():
        pool = arena.pools.get(size)
        mine = slots[sizes == size]
        if pool is None:
            found.append(f"{tier.name}: entries of {size} bytes but no pool of that size")
            continue
        charged += len(mine) * pool.stride
        if len(np.unique(mine)) != len(mine):
            found.append(f"{tier.name}: two entries of {size} bytes share a slot")
        numbers, local = mine // pool.slots_per_slab, mine % pool.slots_per_slab
        issued = np.array([(pool.fresh[n] if n < len(pool.slabs) and pool.slabs[n] is not None
                            else -1) for n in numbers.tolist()], np.int64)
        if np.any(local >= issued):
            found.append(f"{tier.name}: an entry's slot lies outside the live slabs")
        if np.isin(mine, np.asarray(pool.free_slots, np.int64)).any():
            found.append(f"{tier.name}: an entry's slot is on the free list")
    if charged != arena.used_bytes:
        found.append(f"{tier.name}: the arena counts {arena.used_bytes} bytes in use, its "
                     f"entries take {charged}")
    return found
