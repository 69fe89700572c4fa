"""A worker for the soak: mixed match / load / store for a while, every loaded byte checked.

    python -m drills.soak_worker ADDRESS SEED SECONDS UNIVERSE

Prints one JSON line at the end: operations by kind, pages loaded, wrong loads, and
errors by status.
"""

from __future__ import annotations

import collections
import json
import sys
import time

import numpy as np

from drills import keyed, prompts
from tiercache.client import Client
from tiercache.errors import TiercacheError


def soak(address: str, seed: int, seconds: float, universe: int) -> dict:
    rng = np.random.default_rng(seed)
    worker = Client(address, timeout=30).register(prompts.MODEL, prompts.LAYOUT)
    paged, slots = keyed.byte_rows(worker.paged), keyed.byte_rows(worker.slots)
    counts: collections.Counter = collections.Counter()
    rows = list(range(prompts.PAGES, 2 * prompts.PAGES))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tokens = prompts.tokens(int(rng.integers(universe)))
        roll, doing = rng.random(), "match"
        try:
            if roll < 0.1:
                counts["match"] += 1
                worker.match(tokens, prefetch=bool(rng.random() < 0.5))
            elif roll < 0.5:
                counts["load"] += 1
                doing = "load"
                keyed.poison(paged), keyed.poison(slots)
                pages = worker.load(tokens, kv_rows=rows, slot=1).match.pages
                counts["loaded_pages"] += pages
                counts["wrong"] += keyed.wrong_entries(paged, slots, worker.keys(tokens), rows,
                                                       pages, 1) > 0
            else:
                durable = bool(roll > 0.9)
                doing = "durable_store" if durable else "store"
                counts[doing] += 1
                keyed.fill(paged, slots, worker.keys(tokens), list(range(prompts.PAGES)), 0)
                worker.store(tokens, kv_rows=range(prompts.PAGES),
                             checkpoints={prompts.PAGES * prompts.PAGE: 0}, durable=durable)
        except TiercacheError as error:
            status = str(error).rsplit("(", 1)[-1].rstrip(")")
            counts[f"error {doing} {status}"] += 1
            if counts[f"error {doing} {status}"] == 1:
                print(f"{doing}: {error}", file=sys.stderr, flush=True)
    worker.close()
    return dict(counts)


if __name__ == "__main__":
    result = soak(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    print(json.dumps(result), flush=True)
