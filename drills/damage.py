"""Damage to a disk tier, and a child process that opens the damaged tier and reads it.

    python -m drills.damage check DIR PROMPTS

`store` fills a disk tier with PROMPTS prompts of keyed content (keyed.py). The damage
functions break it the ways disks and people do: bytes flipped or values cut short
inside LMDB, bytes flipped or the file cut short underneath it, a garbage lock file, a
file that is not LMDB at all. `check` opens the tier in a child process (a crash there
must not take the test with it), loads every prompt and prints one JSON line: loads
exact, wrong and missed, the damage the engine counted, and whether it moved the
environment aside.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np

from drills import keyed
from drills.worlds import hybrid_layout, prompt_keys, random_buffers
from tiercache.engine import Engine, EngineConfig
from tiercache.policy import PolicyConfig, WriteConfig
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig

LAYOUT = hybrid_layout(page_rows=64, slot_rows=8)
PAGES = 4
ROOT = Path(__file__).resolve().parents[1]


def engine_at(path: str) -> Engine:
    return Engine.open(EngineConfig(
        host=HostConfig(budget_bytes=1 << 22, pin=False),
        disk=DiskConfig(os.path.join(path, "lmdb"), map_size=1 << 26, sync=False),
        policy=PolicyConfig(writes=WriteConfig(host="through"))))


def store(path: str, prompts: int) -> None:
    """A disk tier holding `prompts` prompts (pages and end checkpoints) and nothing else."""
    engine = engine_at(path)
    buffers = random_buffers(LAYOUT, seed=0)
    for n in range(prompts):
        keys = prompt_keys(LAYOUT, n, PAGES)
        keyed.fill(buffers.paged, buffers.slots, keys, list(range(PAGES)), 0)
        engine.store(buffers, keys, range(PAGES), {PAGES: 0})
    engine.close()


def _values(path: str, db: bytes) -> tuple[lmdb.Environment, object, list[bytes]]:
    env = lmdb.open(os.path.join(path, "lmdb"), max_dbs=2, map_size=1 << 26)
    handle = env.open_db(db)
    with env.begin() as txn:
        keys = [bytes(k) for k, _ in txn.cursor(db=handle)]
    return env, handle, keys


def flip_values(path: str, rng: np.random.Generator, count: int, db: bytes = b"data") -> int:
    """Flip one bit in `count` values (or headers, db=b"meta") through LMDB, as bit rot
    inside a value would; returns how many entries were hit."""
    env, handle, keys = _values(path, db)
    hit = rng.choice(len(keys), size=min(count, len(keys)), replace=False)
    with env.begin(write=True) as txn:
        for i in hit.tolist():
            value = bytearray(txn.get(keys[i], db=handle))
            value[int(rng.integers(len(value)))] ^= 1 << int(rng.integers(8))
            txn.put(keys[i], bytes(value), db=handle)
    env.close()
    return len(hit)


def cut_values(path: str, rng: np.random.Generator, count: int) -> int:
    """Cut `count` values short, as a torn write inside a value would."""
    env, handle, keys = _values(path, b"data")
    hit = rng.choice(len(keys), size=min(count, len(keys)), replace=False)
    with env.begin(write=True) as txn:
        for i in hit.tolist():
            value = txn.get(keys[i], db=handle)
            txn.put(keys[i], value[:int(rng.integers(len(value)))], db=handle)
    env.close()
    return len(hit)


def _data_file(path: str) -> str:
    return os.path.join(path, "lmdb", "data.mdb")


def flip_file(path: str, rng: np.random.Generator, count: int, start: int = 0) -> None:
    """Flip bits at `count` random offsets of data.mdb from `start` (under LMDB's feet)."""
    size = os.path.getsize(_data_file(path))
    with open(_data_file(path), "r+b") as f:
        for offset in rng.integers(start, size, count).tolist():
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ (1 << int(rng.integers(8)))]))


def cut_file(path: str, fraction: float) -> None:
    """Cut data.mdb short, as a lost tail of the file would."""
    size = os.path.getsize(_data_file(path))
    os.truncate(_data_file(path), int(size * fraction))


def zero_meta_pages(path: str) -> None:
    """Zero LMDB's two meta pages: no LMDB will open the file."""
    with open(_data_file(path), "r+b") as f:
        f.write(bytes(2 * 4096))


def garble_meta_page(path: str, page: int, rng: np.random.Generator) -> None:
    """Random bytes over one of LMDB's two meta pages; the other stays sound."""
    with open(_data_file(path), "r+b") as f:
        f.seek(page * 4096)
        f.write(rng.bytes(4096))


def garbage_lock(path: str, rng: np.random.Generator) -> None:
    with open(os.path.join(path, "lmdb", "lock.mdb"), "wb") as f:
        f.write(rng.bytes(8192))


def garbage_file(path: str, rng: np.random.Generator) -> None:
    with open(_data_file(path), "wb") as f:
        f.write(rng.bytes(1 << 16))


def check(path: str, prompts: int) -> dict:
    """Open the (damaged) tier, load every prompt into poisoned rows, count the outcomes."""
    engine = engine_at(path)
    buffers = random_buffers(LAYOUT, seed=1)
    counts = {"exact": 0, "wrong": 0, "missed": 0, "partial": 0}
    for n in range(prompts):
        keys = prompt_keys(LAYOUT, n, PAGES)
        keyed.poison(buffers.paged), keyed.poison(buffers.slots)
        pages = engine.load(buffers, keys, list(range(10, 10 + PAGES)), 5).match.pages
        if keyed.wrong_entries(buffers.paged, buffers.slots, keys, list(range(10, 10 + PAGES)),
                               pages, 5):
            counts["wrong"] += 1
        else:
            counts["exact" if pages == PAGES else "partial" if pages else "missed"] += 1
    counters = engine.stats().counters
    engine.close(flush=False)
    return {**counts, "checksum_failures": counters["checksum_failures"],
            "moved_aside": counters["disk_moved_aside"]}


def check_in_child(path: str, prompts: int, timeout: float = 120) -> dict:
    """`check` in its own process; {"crashed": signal} if it died."""
    done = subprocess.run([sys.executable, "-m", "drills.damage", "check", path,
                           str(prompts)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode < 0:
        return {"crashed": -done.returncode, "log": done.stderr[-2000:]}
    if done.returncode != 0:
        return {"failed": done.returncode, "log": done.stderr[-2000:]}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "log": done.stderr}


if __name__ == "__main__":
    if sys.argv[1] == "check":
        print(json.dumps(check(sys.argv[2], int(sys.argv[3]))), flush=True)
