"""A worker that stores and loads through daemon crashes, keeping a journal of what the
daemon acknowledged.

    python -m drills.crash_worker ADDRESS JOURNAL SEED WINDOW

Forever (until killed): register (again, whenever the daemon went away), then store
random prompts, half of them durable, and now and then load one and check its bytes.
Registration n draws prompt ids from [n * WINDOW // 20, that + WINDOW): each daemon life
brings prompts never stored before, so stores keep writing new entries. Journal lines, flushed one by one:
`A P D` before a store of prompt P (D = 1 if durable), `K P D` once acknowledged,
`W P` if a load brought a wrong byte, `L P N` after an exact load of N pages.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from drills import keyed, prompts
from tiercache.client import Client
from tiercache.errors import TiercacheError


def session(address: str, journal, rng: np.random.Generator, lives: list[int], window: int) -> None:
    """One registration's worth of work; raises when the daemon is gone."""
    worker = Client(address, timeout=10).register(prompts.MODEL, prompts.LAYOUT)
    base = lives[0] * (window // 20)
    lives[0] += 1
    paged, slots = keyed.byte_rows(worker.paged), keyed.byte_rows(worker.slots)
    try:
        while True:
            prompt = base + int(rng.integers(window))
            tokens = prompts.tokens(prompt)
            if rng.random() < 0.25:  # a load into other rows, checked byte for byte
                keyed.poison(paged), keyed.poison(slots)
                rows = list(range(prompts.PAGES, 2 * prompts.PAGES))
                pages = worker.load(tokens, kv_rows=rows, slot=1).match.pages
                wrong = keyed.wrong_entries(paged, slots, worker.keys(tokens), rows, pages, 1)
                journal.write(f"W {prompt}\n" if wrong else f"L {prompt} {pages}\n")
                continue
            durable = int(rng.random() < 0.5)
            keyed.fill(paged, slots, worker.keys(tokens), list(range(prompts.PAGES)), 0)
            journal.write(f"A {prompt} {durable}\n")
            journal.flush()
            worker.store(tokens, kv_rows=range(prompts.PAGES),
                         checkpoints={prompts.PAGES * prompts.PAGE: 0}, durable=bool(durable))
            journal.write(f"K {prompt} {durable}\n")
            journal.flush()
    finally:
        worker.close()


def main(address: str, path: str, seed: int, window: int) -> None:
    rng = np.random.default_rng(seed)
    lives = [0]  # registrations that succeeded
    with open(path, "a", buffering=1) as journal:
        while True:
            try:
                session(address, journal, rng, lives, window)
            except TiercacheError:
                time.sleep(0.05)  # the daemon is down or restarting: try again


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
