"""What a store shares beyond this node: KV events for the published tenant only, and the
remote tier for all but the tenants and models kept local."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tiercache_service.fleet import ALL_TENANTS, Fleet, names
from tiercache.events import Change, EventLog
from tiercache.results import Tier


def worker(tenant: str, model: str = "m"):
    return SimpleNamespace(identity=SimpleNamespace(tenant=tenant),
                           namespace=SimpleNamespace(model_id=model),
                           layout=SimpleNamespace(page_tokens=4))


def keys(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**63, (2, 2), dtype=np.uint64)


def published(log: EventLog, *chains: np.ndarray) -> int:
    for chain in chains:
        log.record_tier(Change.STORED, np.zeros(len(chain)), Tier.HOST, chain)
    return sum(len(e.keys) for e in log.take().events)


def test_only_the_published_tenants_stores_reach_the_stream():
    log = EventLog()
    fleet = Fleet(log, event_tenant="acme")
    mine, theirs = keys(1), keys(2)
    fleet.before_store(worker("acme"), mine, b"")
    fleet.before_store(worker("globex"), theirs, b"")
    assert published(log, mine, theirs) == 2  # acme's two pages, none of globex's
    everyone = Fleet(log, event_tenant=ALL_TENANTS)
    everyone.before_store(worker("globex"), theirs, b"")
    assert published(log, theirs) == 2


def test_tenants_and_models_kept_local_do_not_go_remote():
    fleet = Fleet(local_tenants=names("acme, initech"), local_models=names("secret-model"))
    assert fleet.before_store(worker("globex"), keys(3), b"") is True
    assert fleet.before_store(worker("acme"), keys(3), b"") is False
    assert fleet.before_store(worker("globex", "secret-model"), keys(3), b"") is False


def test_event_tokens_must_be_whole_uint32_tokens_of_the_prompt():
    fleet = Fleet(EventLog())
    with pytest.raises(ValueError, match="uint32"):
        fleet.before_store(worker(""), keys(4), b"\x00" * 6)
    with pytest.raises(ValueError, match="at most 4 per key"):
        fleet.before_store(worker(""), keys(4), b"\x00" * 4 * 9)
