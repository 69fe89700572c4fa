"""Key collisions are misses, never another prompt's bytes.

The page hash is narrowed to 12 bits (hashing.narrow_hash_for_tests), so a few hundred
prompts collide many times over. Each page's bytes are a function of its prompt's real
prefix (a full-width key of the same tokens), so a page served for a colliding prompt
shows. Calls given tokens send each page's check (hashing.page_chain) and the cache
keeps it with the entry: a collision is caught and counted. Calls given bare keys send
no checks: the same drill then serves wrong bytes, which is why clients send checks.
"""

from __future__ import annotations

import numpy as np
import pytest

from drills import keyed, prompts
from tiercache.client import Client, EmbeddedClient
from tiercache.engine import EngineConfig
from tiercache.errors import InvalidArgument
from tiercache.hashing import Namespace, narrow_hash_for_tests, page_keys
from tiercache.tiers.host import HostConfig
from tests.service.daemon import daemon_in_this_process

NARROW = narrow_hash_for_tests(12)
PROMPTS = 300


def true_keys(prompt: int) -> list[bytes]:
    """Full-width keys of the prompt's prefixes: what each page's bytes stand for."""
    return page_keys(prompts.tokens(prompt), Namespace("truth", "truth").root(), prompts.PAGE)


def repeats_itself(worker, prompt: int) -> bool:
    """Whether the narrow hash gives one of the prompt's keys twice (requests naming a key
    twice are refused: these prompts are left out, and their refusal checked)."""
    keys = worker.keys(prompts.tokens(prompt))
    return len(set(keys)) < len(keys)


def store_all(worker, with_checks: bool) -> None:
    paged, slots = keyed.byte_rows(worker.paged), keyed.byte_rows(worker.slots)
    for prompt in range(PROMPTS):
        keyed.fill(paged, slots, true_keys(prompt), list(range(prompts.PAGES)), 0)
        tokens = prompts.tokens(prompt)
        call = {"tokens": tokens} if with_checks else {"keys": worker.keys(tokens)}
        store = lambda: worker.store(**call, kv_rows=range(prompts.PAGES),  # noqa: E731
                                     checkpoints={prompts.PAGES * prompts.PAGE: 0})
        if repeats_itself(worker, prompt):
            with pytest.raises(InvalidArgument, match="repeats key"):
                store()
        else:
            store()


def wrong_loads(worker, with_checks: bool) -> tuple[int, int]:
    """(prompts loaded with a wrong byte, prompts loaded whole)."""
    paged, slots = keyed.byte_rows(worker.paged), keyed.byte_rows(worker.slots)
    rows, wrong, whole = list(range(prompts.PAGES, 2 * prompts.PAGES)), 0, 0
    for prompt in range(PROMPTS):
        if repeats_itself(worker, prompt):
            continue
        keyed.poison(paged), keyed.poison(slots)
        tokens = prompts.tokens(prompt)
        call = {"tokens": tokens} if with_checks else {"keys": worker.keys(tokens)}
        pages = worker.load(**call, kv_rows=rows, slot=1).match.pages
        wrong += keyed.wrong_entries(paged, slots, true_keys(prompt), rows, pages, 1) > 0
        whole += pages == prompts.PAGES
    return wrong, whole


def embedded_worker():
    client = EmbeddedClient(EngineConfig(host=HostConfig(budget_bytes=1 << 26, pin=False)))
    return client, client.register(prompts.MODEL, prompts.LAYOUT, hash_name=NARROW)


def test_the_narrow_hash_really_collides():
    worker = embedded_worker()[1]
    keys = [k for prompt in range(PROMPTS) for k in worker.keys(prompts.tokens(prompt))]
    distinct_prefixes = {k for prompt in range(PROMPTS) for k in true_keys(prompt)}
    assert len(set(keys)) < len(distinct_prefixes) - 50  # dozens of pages collide
    assert 0 < sum(repeats_itself(worker, p) for p in range(PROMPTS)) < PROMPTS // 10


def test_a_collision_is_a_counted_miss_when_checks_travel_with_the_keys():
    client, worker = embedded_worker()
    store_all(worker, with_checks=True)
    wrong, whole = wrong_loads(worker, with_checks=True)
    assert wrong == 0 and whole > PROMPTS // 4
    assert client.stats().counters["collisions"] > 0


def test_without_checks_the_same_collisions_serve_another_prompts_bytes():
    # the control: what the checks prevent
    client, worker = embedded_worker()
    store_all(worker, with_checks=False)
    wrong, _ = wrong_loads(worker, with_checks=False)
    assert wrong > 0 and client.stats().counters["collisions"] == 0


@pytest.fixture
def daemon(tmp_path):
    """A daemon in this process (so that it knows the narrowed hash) on a real socket."""
    with daemon_in_this_process(tmp_path, disk=False, host_budget=1 << 26) as served:
        yield served.addresses[0]


def test_checks_cross_the_wire_and_a_collision_is_a_miss_through_the_daemon(daemon):
    client = Client(daemon)
    worker = client.register(prompts.MODEL, prompts.LAYOUT, hash_name=NARROW)
    store_all(worker, with_checks=True)
    wrong, whole = wrong_loads(worker, with_checks=True)
    assert wrong == 0 and whole > PROMPTS // 4
    assert client.stats().counters["collisions"] > 0
    worker.close()


def test_checks_of_the_wrong_length_are_refused(daemon):
    from tiercache.client import Request
    worker = Client(daemon).register(prompts.MODEL, prompts.LAYOUT)
    keys = b"".join(worker.keys(prompts.tokens(0)))
    with pytest.raises(InvalidArgument, match="8 bytes per key"):
        worker._backend.match(Request(keys, np.zeros(2, np.uint64).tobytes()), False)
    worker.close()


def test_entries_stored_by_keys_hit_for_a_caller_that_sends_tokens():
    # A worker that stores with keys (as the transformers adapter does) sends no checks;
    # the same worker matching with tokens sends them. Nothing to compare is not a clash.
    client = EmbeddedClient(EngineConfig(host=HostConfig(budget_bytes=1 << 26, pin=False)))
    worker = client.register(prompts.MODEL, prompts.LAYOUT)
    tokens = prompts.tokens(7)
    keyed.fill(keyed.byte_rows(worker.paged), keyed.byte_rows(worker.slots), worker.keys(tokens),
               list(range(prompts.PAGES)), 0)
    worker.store(keys=worker.keys(tokens), kv_rows=range(prompts.PAGES),
                 checkpoints={prompts.PAGES * prompts.PAGE: 0})
    assert worker.match(tokens).pages == prompts.PAGES
    assert client.engine.stats().counters.get("collisions", 0) == 0
