"""Sustained load: worker processes doing mixed match / load / store against a daemon
whose budgets are tiny, so that every store evicts, for minutes on end.

Each worker (drills/soak_worker.py) draws prompts from a universe much larger
than the budgets hold, loads (checking every byte against its key) or stores (a tenth
of the stores durable). The daemon's resident memory is sampled throughout; after a
warm-up it must stay flat.

    python -m benchmarks.soak [--workers 8] [--seconds 600]
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import print_summary, print_table
from tiercache_service.process import spawn
from tiercache.client import Client

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ("--host-budget", "2MiB", "--disk-map-size", "8MiB", "--grace-seconds", "5")
MiB = 1 << 20


@dataclass
class Soak:
    counts: collections.Counter = field(default_factory=collections.Counter)
    rss: list[tuple[float, int, int]] = field(default_factory=list)  # (seconds, bytes, anonymous)
    counters: dict[str, int] = field(default_factory=dict)  # the daemon's, at the end
    exits: list[int] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(n for kind, n in self.counts.items() if kind.startswith("error"))

    def growth(self, warmup: float, column: int = 1) -> int:
        """Resident bytes (column 1: all, 2: anonymous, i.e. not the LMDB map's file pages)
        gained from the end of the warm-up to the end."""
        after = [s[column] for s in self.rss if s[0] >= warmup] or [s[column] for s in self.rss]
        return after[-1] - after[0]


def rss(pid: int) -> tuple[int, int]:
    """Resident bytes of a process: all of them, and the anonymous ones."""
    with open(f"/proc/{pid}/status") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                  if line.startswith(("VmRSS", "RssAnon"))}
    return fields["VmRSS"], fields["RssAnon"]


def sample(pid: int, into: list, stop: threading.Event, every: float) -> None:
    start = time.monotonic()
    while not stop.wait(every):
        try:
            into.append((time.monotonic() - start, *rss(pid)))
        except (FileNotFoundError, KeyError):
            return


def run(workers: int, seconds: float, universe: int = 3000, sample_every: float = 5.0) -> Soak:
    result = Soak()
    with tempfile.TemporaryDirectory() as folder, spawn(folder, *FLAGS, forward_output=True) as (address, daemon):
        stop = threading.Event()
        sampler = threading.Thread(target=sample, args=(daemon.pid, result.rss, stop, sample_every))
        sampler.start()
        children = [subprocess.Popen([sys.executable, "-m", "drills.soak_worker", address,
                                      str(n), str(seconds), str(universe)], cwd=ROOT,
                                     stdout=subprocess.PIPE, text=True) for n in range(workers)]
        for child in children:
            out, _ = child.communicate(timeout=seconds + 300)
            result.exits.append(child.returncode)
            if child.returncode == 0:
                result.counts.update(json.loads(out.strip().splitlines()[-1]))
        stop.set()
        sampler.join()
        result.counters = Client(address).stats().counters
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=600)
    args = parser.parse_args()
    result = run(args.workers, args.seconds)
    warmup = min(60.0, args.seconds / 5)
    ops = sum(result.counts[k] for k in ("match", "load", "store", "durable_store"))
    print_table(f"soak: {args.workers} workers for {args.seconds:.0f} s, budgets {FLAGS[1]} host "
                f"/ {FLAGS[3]} LMDB map", ["what", "count"],
                sorted(result.counts.items()) + [
                    (f"daemon {k}", result.counters.get(k, 0)) for k in (
                        "evicted_host", "evicted_disk", "demoted", "disk_writes", "promoted",
                        "checksum_failures", "collisions")])
    rss_mib = [b / MiB for _, b, _ in result.rss]
    print(f"daemon RSS MiB: first {rss_mib[0]:.1f}, after {warmup:.0f} s warm-up "
          f"{[b for t, b, _ in result.rss if t >= warmup][0] / MiB:.1f}, last {rss_mib[-1]:.1f}, "
          f"max {max(rss_mib):.1f} ({len(rss_mib)} samples); worker exits {result.exits}")
    step = max(1, len(result.rss) // 12)
    print("daemon RSS over time (s: all / anonymous MiB): " + ", ".join(
        f"{t:.0f}: {b / MiB:.1f} / {a / MiB:.1f}" for t, b, a in result.rss[::step]))
    print_summary(ops=ops, ops_per_s=ops / args.seconds, errors=result.errors,
                  wrong_loads=result.counts["wrong"], loaded_pages=result.counts["loaded_pages"],
                  rss_growth_mib=result.growth(warmup) / MiB,
                  anon_growth_mib=result.growth(warmup, 2) / MiB, worker_failures=sum(
                      code != 0 for code in result.exits))


if __name__ == "__main__":
    main()
