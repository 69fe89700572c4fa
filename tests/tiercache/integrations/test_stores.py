"""Stores behind the prefill (`integrations.stores`): the logits come back while the store
is still running, the next prefill does not wait for it (the other set of rows and slots),
the one after waits only for the store still reading its set, and a store that fails is
counted, logged and leaves no entry behind."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.23")

from tiercache import failpoints, invariants  # noqa: E402
from tiercache.engine import Engine, EngineConfig  # noqa: E402
from tiercache.integrations.transformers import AdapterConfig, HybridCacheAdapter  # noqa: E402
from tiercache.tiers.host import HostConfig  # noqa: E402
from tests.tiercache.integrations.tiny import PAGE, tiny_qwen3_next, tokens  # noqa: E402

# The stores run on the adapter's thread while the test calls the engine: the books are
# checked once everything has settled (tests/tiercache/conftest.py).
pytestmark = pytest.mark.concurrent
ADAPTER = AdapterConfig(model_id="tiny-qwen3-next@seed0", page_tokens=PAGE, max_tokens=128)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_qwen3_next()


@pytest.fixture
def adapter(model):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 20)))
    adapter = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    yield adapter
    adapter.close()
    assert not invariants.violations(engine)
    engine.close()


def test_prefill_returns_before_its_store_and_the_next_one_does_not_wait(model, adapter):
    gate = threading.Event()
    entered = threading.Event()

    def hold(name: str) -> None:  # the engine copies nothing until the gate opens
        entered.set()
        assert gate.wait(30)

    with failpoints.armed("store.before_gather", hold):
        first = adapter.prefill(model, tokens(37, seed=40))
        assert entered.wait(30)
        assert not first.store.done()  # the logits are back, the store is still held
        # Nothing is visible yet (published only once copied); the next prefill uses the
        # other set of rows and slots, so it runs while the first store is held.
        assert adapter.match(tokens(37, seed=40)).pages == 0
        second = adapter.prefill(model, tokens(29, seed=41))
        assert not first.store.done() and not second.store.done()
        gate.set()
    assert first.store.result().checkpoints == (4,)
    assert second.store.result().checkpoints == (3,)
    assert adapter.match(tokens(37, seed=40)[0, :36]).pages == 4


def test_a_third_prefill_waits_for_the_store_reading_its_rows(model, adapter):
    gate = threading.Event()
    with failpoints.armed("store.before_gather", lambda name: gate.wait(30)):
        first = adapter.prefill(model, tokens(37, seed=42))
        adapter.prefill(model, tokens(37, seed=43))
        # The third needs the first's set back: it waits until that store is done.
        threading.Timer(0.3, gate.set).start()
        third = adapter.prefill(model, tokens(37, seed=44))
        assert first.store.done()
    assert third.store.result().checkpoints == (4,)


def test_a_failed_store_is_counted_logged_and_leaves_nothing(model, adapter, caplog):
    prompt = tokens(37, seed=45)
    with caplog.at_level(logging.WARNING, logger="tiercache.integrations"):
        with failpoints.armed("store.before_publish", "raise"):
            run = adapter.prefill(model, prompt)
            adapter.flush()  # waits, and does not raise: the failure is the store's
    assert run.store.exception() is not None
    assert adapter.stores.failed == 1
    assert "a background store failed (1 so far)" in caplog.text
    match = adapter.match(prompt[0, :36])
    assert (match.pages, match.kv_pages) == (0, 0)  # no page, no checkpoint: nothing half-stored
    # The next store of the same prompt goes through.
    again = adapter.prefill(model, prompt)
    assert again.store.result().checkpoints == (4,)
    assert adapter.match(prompt[0, :36]).pages == 4


def test_close_waits_for_the_stores_in_flight(model):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 20)))
    adapter = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    gate = threading.Event()
    with failpoints.armed("store.before_gather", lambda name: gate.wait(30)):
        run = adapter.prefill(model, tokens(37, seed=46))
        threading.Timer(0.3, gate.set).start()
        adapter.close()
        assert run.store.done() and run.store.exception() is None
    assert engine.match(adapter.layout, adapter.keys(tokens(37, seed=46))).pages == 4
    engine.close()
