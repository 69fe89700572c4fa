"""The memory a daemon needs for the smallest entries it takes, against its host budget.

A daemon with host budget B is sent the smallest entries registration allows (64-byte
pages) until four times as many entries as fit were stored; its anonymous resident
memory (the host arena's slabs and the books; shared memory is the worker's) is read
before and after. The limit beside it is the budget: every slot is charged at least
1 KiB, so B holds at most B / 1 KiB entries, and what the daemon needs beyond B is its
books for them.

    python -m benchmarks.tiny_entries [--budgets 16 64 256]
"""

from __future__ import annotations

import argparse
import tempfile

from benchmarks.common import print_summary, print_table
from tiercache_service.process import spawn
from tiercache.client import Client
from tiercache.layout import BufferSpec, Layout

MiB = 1 << 20
BATCH = 1 << 12
TINY = Layout(16, paged=(BufferSpec("kv", BATCH, (64,), "uint8"),))


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


def measure(budget_mib: int) -> tuple[int, int, int]:
    """(entries held, bytes the daemon grew by, bytes beyond the budget per entry)."""
    with tempfile.TemporaryDirectory() as folder, spawn(
            folder, "--no-disk", "--host-budget", f"{budget_mib}MiB") as (address, daemon):
        client = Client(address)
        worker = client.register("tiny", TINY)
        worker.store(keys=[bytes(15) + b"\1"], kv_rows=[0])  # code paths warm
        before = rss_anon(daemon.pid)
        fits = budget_mib * MiB // 1024
        for start in range(1, 4 * fits, BATCH):
            keys = [k.to_bytes(16, "little") for k in range(start, start + BATCH)]
            worker.store(keys=keys, kv_rows=range(BATCH))
        grown = rss_anon(daemon.pid) - before
        entries = client.stats().tiers[0].entries
        worker.close()
    return entries, grown, max(0, grown - budget_mib * MiB) // max(entries, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    args = parser.parse_args()
    rows = []
    for budget in args.budgets:
        entries, grown, per_entry = measure(budget)
        rows.append((f"{budget} MiB", entries, f"{grown / MiB:.1f} MiB", f"{grown / (budget * MiB):.2f}",
                     per_entry))
    print_table("64-byte entries, 4x what the host budget holds", ["host budget", "entries held",
                "daemon grew", "grown / budget", "bytes beyond budget per entry"], rows)
    print_summary(**{f"grown_per_budget_{b}": round(float(r[3]), 3) for b, r in zip(args.budgets, rows)})


if __name__ == "__main__":
    main()
