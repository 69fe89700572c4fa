"""Random damage to a disk tier, many times over: 0 crashes and 0 wrong bytes allowed.

Each round stores PROMPTS prompts of keyed content, breaks the LMDB environment in one to
three random ways (bits flipped in values or headers through LMDB, values cut short, bits
flipped in data.mdb under LMDB, data.mdb cut short, lock.mdb garbage, the meta pages
zeroed, a file that is not LMDB), then a child process opens it and loads every prompt
(drills/damage.py). The peer figure is Redis's corrupt-dump fuzzer, which
must end with 0 crashes.

    python -m benchmarks.corruption [--rounds 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time

import numpy as np

from benchmarks.common import print_summary, print_table
from drills import damage

PROMPTS = 16

KINDS = {
    "flip values": lambda p, rng: damage.flip_values(p, rng, int(rng.integers(1, 8))),
    "flip headers": lambda p, rng: damage.flip_values(p, rng, int(rng.integers(1, 8)), db=b"meta"),
    "cut values": lambda p, rng: damage.cut_values(p, rng, int(rng.integers(1, 8))),
    "flip file": lambda p, rng: damage.flip_file(p, rng, int(rng.integers(1, 200)), start=8192),
    "cut file": lambda p, rng: damage.cut_file(p, float(rng.uniform(0.05, 0.95))),
    "garbage lock": damage.garbage_lock,
    "zero meta pages": lambda p, rng: damage.zero_meta_pages(p),
    "not LMDB": damage.garbage_file,
}


def one_round(rng: np.random.Generator) -> tuple[list[str], dict]:
    with tempfile.TemporaryDirectory() as folder:
        damage.store(folder, PROMPTS)
        picked = set(rng.choice(sorted(KINDS), size=int(rng.integers(1, 4)), replace=False))
        chosen = [kind for kind in KINDS if kind in picked]  # through LMDB first, then under it
        for kind in chosen:
            KINDS[kind](folder, rng)
        return chosen, damage.check_in_child(folder, PROMPTS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    per_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    start = time.time()
    for _ in range(args.rounds):
        chosen, result = one_round(rng)
        outcome = ("crashed" if "crashed" in result else "failed" if "failed" in result
                   else "wrong" if result["wrong"] else "ok")
        totals[outcome] += 1
        for key in ("exact", "partial", "missed", "wrong", "checksum_failures", "moved_aside"):
            totals[key] += result.get(key, 0)
        for kind in chosen:
            per_kind[kind]["rounds"] += 1
            per_kind[kind][outcome] += 1
            per_kind[kind]["moved aside"] += result.get("moved_aside", 0)
        if outcome != "ok":
            print(f"round with {chosen}: {outcome}: {result.get('log', '')[-500:]}", flush=True)
    print_table(f"{args.rounds} rounds of random damage, {PROMPTS} prompts each "
                f"({time.time() - start:.0f} s)",
                ["damage", "rounds", "crashed", "failed", "wrong bytes", "moved aside"],
                [(kind, c["rounds"], c["crashed"], c["failed"], c["wrong"], c["moved aside"])
                 for kind, c in sorted(per_kind.items())])
    print(f"loads: {totals['exact']} exact, {totals['partial']} shorter, {totals['missed']} "
          f"missed, {totals['wrong']} wrong; damage counted {totals['checksum_failures']} times; "
          "peer: Redis corrupt-dump fuzzer, 0 crashes required")
    print_summary(rounds=args.rounds, crashes=totals["crashed"], failures=totals["failed"],
                  wrong_loads=totals["wrong"], moved_aside=totals["moved_aside"],
                  damage_counted=totals["checksum_failures"])


if __name__ == "__main__":
    main()
