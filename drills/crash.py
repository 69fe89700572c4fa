"""Kill the daemon at random points while workers store, restart it, check the history.

Worker processes (drills/crash_worker.py) store prompts of keyed content
without pause, half of them durable, and journal what was acknowledged. Each cycle the
daemon is SIGKILLed: at a random time, or by itself at an armed failpoint (inside an
LMDB commit, between copying and publishing, ...). Then, with the daemon dead, the LMDB
environment is surveyed (every checksum, every byte against its key), the daemon is
restarted and prompts are loaded through it. Each daemon life, the workers draw from a
window of prompt ids that has moved on, so stores keep writing entries never written
before (and the failpoints in the write path keep firing). A cycle fails if:
  - the environment does not open, or the daemon had to move it aside;
  - a prompt whose durable store was acknowledged is not wholly on disk, or loads short;
  - any entry on disk or any loaded byte differs from what its key stands for;
  - an entry of a prompt no worker ever stored is on disk, or a load of one hits.

    python -m benchmarks.crash_loop [--cycles 1000] [--workers 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import numpy as np

from benchmarks.common import print_summary, print_table
from drills import keyed, prompts
from tiercache.client import Client
from tiercache.errors import TiercacheError
from tiercache.hashing import Namespace, key_array, page_keys
from tiercache import tenancy
from tiercache.tiers.lmdb_format import DATA_DB, META_DB, verify_entry

ROOT = Path(__file__).resolve().parents[1]
KILL_POINTS = {"store.before_gather": 0.05, "store.before_publish": 0.05,
               "disk.before_commit": 0.2, "disk.after_commit": 0.2}
WINDOW = 2000  # prompt ids a worker draws from in one daemon life (the window moves on)
NEVER = 10**9  # prompt ids from here on are never stored
DEEP_SAMPLE = 300  # older prompts whose every byte is checked again each cycle
FLAGS = ("--host-budget", "1MiB", "--disk-map-size", "2GiB", "--grace-seconds", "1")


@dataclass
class History:
    """What the workers' journals say so far, and what the checks found."""

    attempted: set[int] = field(default_factory=set)
    recent: set[int] = field(default_factory=set)  # attempted since the last offline check
    durable: set[int] = field(default_factory=set)  # a durable store was acknowledged
    known: set[bytes] = field(default_factory=set)  # LMDB keys of every attempted prompt
    acks: int = 0
    offsets: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ["cycles", "killed_at_random", "killed_at_failpoint", "durable_acks", "plain_acks",
         "entries_on_disk", "entries_checked", "prompts_loaded", "worker_loads", "lost",
         "wrong", "unexpected", "env_failures"], 0))

    def read(self, journals: list[Path]) -> None:
        """Take in the journal lines written since the last call (whole lines only)."""
        for path in journals:
            with open(path, "rb") as f:
                f.seek(self.offsets.get(str(path), 0))
                data = f.read()
            whole = data[:data.rfind(b"\n") + 1]
            self.offsets[str(path)] = self.offsets.get(str(path), 0) + len(whole)
            for line in whole.decode().splitlines():
                self._line(line.split())

    def _line(self, words: list[str]) -> None:
        kind, prompt = words[0], int(words[1])
        if kind == "A":
            self.attempted.add(prompt)
            self.recent.add(prompt)
        elif kind == "K":
            durable = words[2] == "1"
            self.counts["durable_acks" if durable else "plain_acks"] += 1
            if durable:
                self.durable.add(prompt)
        elif kind == "W":
            self.counts["wrong"] += 1
        elif kind == "L":
            self.counts["worker_loads"] += 1


def start_daemon(data_dir: Path, log: Path, failpoints: str) -> tuple[subprocess.Popen, str]:
    socket = data_dir / "tiercache.sock"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TIERCACHE_FAILPOINTS": failpoints}
    before = log.stat().st_size if log.exists() else 0  # the log of this start only
    with open(log, "a") as out:
        process = subprocess.Popen([sys.executable, "-m", "tiercache_service.cli", "serve", "--data-dir",
                                    str(data_dir), "--socket", str(socket), "--metrics-address",
                                    "127.0.0.1:0", *FLAGS],
                                   stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.time() + 60
    while time.time() < deadline:
        # whether it ended is asked before its log is read: an armed failpoint may kill it
        # right after it starts listening (stores arrive at once), and such a daemon did
        # start (the caller's checks expect it to die under them)
        ended = process.poll() is not None
        if f"listening on unix:{socket}" in log.read_bytes()[before:].decode(errors="replace"):
            return process, f"unix:{socket}"
        if ended:
            break
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"the daemon did not start: {log.read_text()[-2000:]}")


@functools.lru_cache(maxsize=None)
def worker_keys(prompt: int) -> tuple[bytes, ...]:
    """Prompt `prompt`'s page keys as its workers compute them (the drill's namespace)."""
    root = Namespace(prompts.MODEL, prompts.LAYOUT.fingerprint).root()
    return tuple(page_keys(prompts.tokens(prompt), root, prompts.PAGE))


def stored_as(prompt: int, mask: np.ndarray) -> list[tuple[bytes, bytes, bytes]]:
    """(LMDB key: kind byte + the daemon's key, worker key, content kind) of each entry a
    store of `prompt` writes: its pages and the checkpoint at its end. The daemon keeps
    the keys it is sent masked for the namespace (tiercache.tenancy)."""
    keys = worker_keys(prompt)
    daemon = tenancy.masked(key_array(list(keys)), mask).tobytes()
    entries = [(b"\0" + daemon[16 * n:16 * n + 16], key, keyed.PAGE) for n, key in enumerate(keys)]
    return entries + [(b"\1" + daemon[-16:], keys[-1], keyed.CHECKPOINT)]


def check_offline(data_dir: Path, history: History, rng: np.random.Generator) -> None:
    """With the daemon dead, straight from LMDB: no entry of a prompt nobody stored; every
    prompt whose durable store was acknowledged wholly there, headers sound, sizes right;
    the prompts stored since the last check (and a sample of older ones) checksummed and
    compared byte for byte with their keys' content."""
    root = Namespace(prompts.MODEL, prompts.LAYOUT.fingerprint).root()
    mask = tenancy.namespace_mask(tenancy.load_secret(str(data_dir / "secret")), root)
    for prompt in history.recent:
        history.known.update(dkey for dkey, _, _ in stored_as(prompt, mask))
    older = sorted(history.attempted - history.recent)
    deep = history.recent | set(rng.permutation(older)[:DEEP_SAMPLE].tolist())
    env = lmdb.open(str(data_dir / "lmdb"), readonly=True, lock=False, max_dbs=2)
    try:
        meta, data = env.open_db(META_DB, create=False), env.open_db(DATA_DB, create=False)
        with env.begin(buffers=True) as txn:
            for dkey in txn.cursor(db=meta).iternext(keys=True, values=False):
                history.counts["entries_on_disk"] += 1
                history.counts["unexpected"] += bytes(dkey) not in history.known
            for prompt in history.durable | deep:
                missing = _check_prompt(txn, meta, data, stored_as(prompt, mask), history,
                                        prompt in deep)
                history.counts["lost"] += missing and prompt in history.durable
    finally:
        env.close()
    history.recent = set()


def _check_prompt(txn, meta, data, entries, history: History, deep: bool) -> bool:
    """Whether an entry of the prompt is missing; wrong entries are counted."""
    missing = False
    for dkey, key, what in entries:
        header, payload = txn.get(dkey, db=meta), txn.get(dkey, db=data)
        if header is None:
            missing = True
            continue
        history.counts["entries_checked"] += deep
        sound = verify_entry(dkey, bytes(header), payload, deep) is not None
        exact = not deep or (sound and np.array_equal(
            np.frombuffer(payload, np.uint8), keyed.content(key, what, len(payload))))
        history.counts["wrong"] += not (sound and exact)
    return missing


def check_online(verifier, history: History, rng: np.random.Generator) -> None:
    """Through the restarted daemon: durable prompts load whole and exact, others exact if
    at all, prompts never stored miss."""
    paged, slots = keyed.byte_rows(verifier.paged), keyed.byte_rows(verifier.slots)
    rows = list(range(2 * prompts.PAGES, 3 * prompts.PAGES))
    durable, other = sorted(history.durable), sorted(history.attempted - history.durable)
    picks = [(p, True) for p in rng.permutation(durable)[:30].tolist()]
    picks += [(p, False) for p in rng.permutation(other)[:10].tolist()]
    picks += [(NEVER + int(p), False) for p in rng.integers(0, 10**6, 5)]
    for prompt, must_hit in picks:
        tokens = prompts.tokens(prompt)
        keyed.poison(paged), keyed.poison(slots)
        pages = verifier.load(tokens, kv_rows=rows, slot=2).match.pages
        history.counts["prompts_loaded"] += 1
        history.counts["wrong"] += keyed.wrong_entries(paged, slots, verifier.keys(tokens), rows,
                                                       pages, 2) > 0
        history.counts["lost"] += must_hit and pages != prompts.PAGES
        history.counts["unexpected"] += prompt >= NEVER and pages > 0


def cycle(data_dir: Path, journals: list[Path], history: History, rng: np.random.Generator) -> None:
    point = str(rng.choice(sorted(KILL_POINTS))) if rng.random() < 0.4 else ""
    armed = f"{point}=kill({KILL_POINTS[point]})" if point else ""
    daemon, address = start_daemon(data_dir, data_dir / "daemon.log", armed)
    try:
        check_restarted(daemon, address, history, rng)
        deadline = time.time() + (4.0 if point else float(rng.uniform(0.3, 2.0)))
        while daemon.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        by_itself = daemon.poll() is not None
        history.counts["killed_at_failpoint" if by_itself else "killed_at_random"] += 1
    finally:
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
    history.read(journals)
    check_offline(data_dir, history, rng)
    history.counts["cycles"] += 1


def check_restarted(daemon: subprocess.Popen, address: str, history: History,
                    rng: np.random.Generator) -> None:
    try:
        client = Client(address, timeout=10)
        history.counts["env_failures"] += client.stats().counters["disk_moved_aside"]
        verifier = client.register(prompts.MODEL, prompts.LAYOUT)
        check_online(verifier, history, rng)
        verifier.close()
    except TiercacheError as error:  # the armed failpoint may kill it during the checks
        try:  # its socket closes a moment before it can be reaped
            daemon.wait(timeout=5)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the restarted daemon failed a check: {error}") from error


def wait_for_journals(journals: list[Path], children: list[subprocess.Popen]) -> None:
    """Workers open their journals once imported (slow where torch finds CUDA): the first
    cycle waits for them, so that it is not over before they began."""
    deadline = time.time() + 300
    while not all(path.exists() for path in journals):
        if time.time() > deadline or any(child.poll() is not None for child in children):
            raise RuntimeError("the crash workers did not start (see their output above)")
        time.sleep(0.1)


def run(cycles: int, workers: int = 2, seed: int = 0, data_dir: Path | None = None,
        progress: bool = False) -> History:
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as scratch:
        data_dir = Path(data_dir or scratch)
        data_dir.mkdir(parents=True, exist_ok=True)
        journals = [data_dir / f"journal-{n}.txt" for n in range(workers)]
        address = f"unix:{data_dir / 'tiercache.sock'}"
        children = [subprocess.Popen([sys.executable, "-m", "drills.crash_worker", address,
                                      str(journal), str(seed * 100 + n), str(WINDOW)], cwd=ROOT)
                    for n, journal in enumerate(journals)]
        history = History()
        try:
            wait_for_journals(journals, children)
            for n in range(cycles):
                cycle(data_dir, journals, history, rng)
                if progress and (n + 1) % 25 == 0:
                    print(f"cycle {n + 1}: {history.counts}", flush=True)
        finally:
            for child in children:
                child.kill()
                child.wait()
        return history


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.time()
    history = run(args.cycles, args.workers, args.seed, progress=True)
    counts = history.counts
    print_table(f"crash loop: {args.cycles} SIGKILLs, {args.workers} workers "
                f"({time.time() - start:.0f} s)", ["what", "count"], list(counts.items()))
    print(f"prompts with a durable store acknowledged: {len(history.durable)}; "
          f"peer: etcd's robustness tests (failpoint kills, history checked against a model)")
    print_summary(**counts)


if __name__ == "__main__":
    main()
