"""The transformers adapter on tiny random hybrid models (float32, CPU, no downloads).

The pivotal property: a prefix stored by one adapter, pushed to disk and loaded by a
fresh one continues bit-identically to the same checkpoint kept in memory, and within
float32 rounding of a full prefill. The stores running behind a prefill are tested in
test_stores.py, the one-pass capture across model families in test_capture.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.23")

import tiercache  # noqa: E402
from tiercache.client import EmbeddedClient  # noqa: E402
from tiercache.engine import Engine, EngineConfig  # noqa: E402
from tiercache.results import StopReason, Tier  # noqa: E402
from tiercache.integrations.transformers import (  # noqa: E402
    AdapterConfig, CacheSpec, HybridCacheAdapter, UnsupportedCache, device_buffers)
from tiercache.tiers.disk import DiskConfig  # noqa: E402
from tiercache.tiers.host import HostConfig  # noqa: E402
from tests.tiercache.integrations.tiny import (  # noqa: E402
    PAGE, VOCAB, captured, continued, full_prefill, greedy, in_memory, tiny_qwen3_next, tokens)

ADAPTER = AdapterConfig(model_id="tiny-qwen3-next@seed0", page_tokens=PAGE, max_tokens=128)
MiB = 1 << 20


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_qwen3_next()


@pytest.fixture
def calls(model):
    """Token counts of every forward pass the model makes."""
    seen: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    yield seen
    handle.remove()


def bytes_by_tier(match, layout) -> dict[Tier, int]:
    """The bytes a load of `match` copies out of each tier."""
    out: dict[Tier, int] = {}
    for tier, nbytes in [(t, layout.page_bytes) for t in match.page_tiers] + [
            (match.checkpoint_tier, layout.checkpoint_bytes)]:
        out[tier] = out.get(tier, 0) + nbytes
    return out


def disk_config(path) -> DiskConfig:
    return DiskConfig(str(path / "lmdb"), map_size=64 * MiB, sync=False)


@pytest.mark.parametrize("push", ["restart", "small_host"])
def test_prefix_from_disk_continues_bit_exactly(model, calls, tmp_path, push):
    # 37 tokens: ONE forward pass, which keeps the state after page 4 (token 32) on the
    # way; pages 1-4 and that state are stored behind the return.
    first = tokens(37, seed=1)
    host = HostConfig(budget_bytes=MiB if push == "restart" else 12 * 1024)
    config = EngineConfig(host=host, disk=disk_config(tmp_path))
    engine = Engine.open(config)
    adapter = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    calls.clear()
    run = adapter.prefill(model, first)
    assert (run.loaded_tokens, run.chunks, run.checkpoints, calls) == (0, (37,), (4,), [37])
    assert run.store.result().checkpoints == (4,)

    # Push the entries out of the host: a restarted engine rebuilds its index from LMDB
    # alone; a small host demotes the coldest entries when another prompt needs room.
    if push == "restart":
        adapter.close()
        engine.close()
        engine = Engine.open(config)
    else:
        adapter.prefill(model, tokens(37, seed=2))
        adapter.flush()

    # A fresh adapter loads a prompt that shares the first 35 tokens: the hit is 4 pages
    # and the checkpoint after them, read from disk (after a restart, nothing else).
    second = torch.cat([first[:, :35], tokens(10, seed=3)], dim=1)
    fresh = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    match = fresh.match(second[0, :-1])
    assert match.pages == 4
    if push == "restart":
        assert match.page_tiers == (Tier.DISK,) * 4 and match.checkpoint_tier == Tier.DISK
    else:
        assert Tier.DISK in (*match.page_tiers, match.checkpoint_tier)
    restored = fresh.load(second[0, :-1])
    assert restored.tokens == 32
    assert restored.load.bytes_from == bytes_by_tier(match, fresh.layout)

    # Continuing from it: exactly the 13 remaining tokens are computed, bit-identical to
    # the same checkpoint kept in memory (captured in one pass over the first prompt),
    # within rounding of a full prefill.
    calls.clear()
    ours = continued(model, restored.cache, second[:, 32:])
    assert calls == [13]
    kept = continued(model, captured(model, first, 32), second[:, 32:])
    assert torch.equal(ours, kept), f"max |delta| = {(ours - kept).abs().max()}"
    torch.testing.assert_close(ours, full_prefill(model, second)[:, 32:], atol=1e-4, rtol=0)

    # Greedy generation from a loaded cache matches generation from scratch.
    again = fresh.load(second[0, :-1])
    assert torch.equal(greedy(model, second, again.cache), greedy(model, second))
    fresh.close()
    engine.close()


def test_host_hit_at_a_checkpoint_prefills_exactly_the_rest(model, calls):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    adapter = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    first = tokens(37, seed=4)
    adapter.prefill(model, first)
    adapter.flush()

    # The second prompt shares exactly the 4 stored pages, then has 6 tokens of its own:
    # one forward pass over those 6, from the host tier, and nothing new to store.
    second = torch.cat([first[:, :32], tokens(6, seed=5)], dim=1)
    calls.clear()
    run = adapter.prefill(model, second)
    assert (run.loaded_tokens, run.chunks, calls) == (32, (6,), [6])
    layout = adapter.layout
    assert run.load.match.page_tiers == (Tier.HOST,) * 4
    assert run.load.bytes_from == {Tier.HOST: 4 * layout.page_bytes + layout.checkpoint_bytes}
    assert (run.checkpoints, run.store) == ((), None)
    assert torch.equal(run.logits, continued(model, captured(model, first, 32), second[:, 32:]))
    adapter.close()
    engine.close()


@pytest.mark.parametrize("one_pass", [True, False])
def test_checkpoints_every_n_pages_in_one_pass_or_in_chunks(model, calls, one_pass):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    config = dataclasses.replace(ADAPTER, checkpoint_every=2, one_pass=one_pass)
    adapter = HybridCacheAdapter.for_model(model, engine, config)

    # 45 tokens, 5 full pages: states after pages 2, 4 and 5, in one pass or in passes
    # that end there (the fallback for kernels that cannot be segmented).
    first = tokens(45, seed=6)
    calls.clear()
    run = adapter.prefill(model, first)
    assert run.chunks == ((45,) if one_pass else (16, 16, 8, 5))
    assert calls == list(run.chunks) and run.checkpoints == (2, 4, 5)
    assert run.store.result().checkpoints == (2, 4, 5)
    torch.testing.assert_close(run.logits, full_prefill(model, first), atol=1e-4, rtol=0)

    # A prompt that leaves the first one inside page 3 resumes at the page-2 checkpoint,
    # keeps the state after its page 3 on the way, and continues as the state kept in
    # memory does when computed the same way (a chunked pass stopped there: the same
    # within rounding).
    second = torch.cat([first[:, :20], tokens(9, seed=7)], dim=1)
    calls.clear()
    run = adapter.prefill(model, second)
    assert (run.loaded_tokens, run.checkpoints) == (16, (3,))
    assert calls == ([13] if one_pass else [8, 5])
    if one_pass:
        kept = continued(model, captured(model, first, 16), second[:, 16:], cuts=(8,))
    else:
        kept = in_memory(model, second, [16, 8, 5], keep=2)
    assert torch.equal(run.logits, kept)
    torch.testing.assert_close(run.logits, full_prefill(model, second)[:, 16:], atol=1e-4, rtol=0)
    adapter.close()
    engine.close()


class Recorder:
    """A registered worker that notes each call the adapter makes: (call, keys sent, first_page)."""

    def __init__(self, worker) -> None:
        self.worker, self.calls = worker, []

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def match(self, tokens=None, *, keys=None):
        self.calls.append(("match", len(keys), 0))
        return self.worker.match(keys=keys)

    def load(self, tokens=None, *, keys=None, kv_rows=(), slot=None):
        self.calls.append(("load", len(keys), 0))
        return self.worker.load(keys=keys, kv_rows=kv_rows, slot=slot)

    def store(self, tokens=None, *, keys=None, kv_rows=(), checkpoints=None, first_page=0):
        self.calls.append(("store", len(keys), first_page))
        return self.worker.store(keys=keys, kv_rows=kv_rows, checkpoints=checkpoints,
                                 first_page=first_page)


def test_a_hit_is_one_call_and_its_store_sends_only_what_it_adds(model):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    spec = CacheSpec.probe(model, lambda: transformers.DynamicCache(config=model.config))
    layout = spec.layout(PAGE, ADAPTER.rows, ADAPTER.slots)
    worker = Recorder(EmbeddedClient(engine).register(ADAPTER.model_id, layout))
    adapter = HybridCacheAdapter(worker, spec, ADAPTER, lambda: transformers.DynamicCache(
        config=model.config), "cpu")
    first = tokens(37, seed=50)
    adapter.prefill(model, first).store.result()
    assert worker.calls == [("load", 4, 0), ("store", 4, 0)]  # a miss: every page is new

    # 46 tokens sharing the first 4 pages: one Load before the logits; behind them, one
    # Store of page 5 and the state after it, sent from the hit's last page on (page 4).
    worker.calls.clear()
    second = torch.cat([first[:, :32], tokens(14, seed=51)], dim=1)
    run = adapter.prefill(model, second)
    assert (run.loaded_tokens, run.checkpoints) == (32, (5,))
    assert run.store.result().checkpoints == (5,)
    assert worker.calls == [("load", 5, 0), ("store", 2, 3)]
    assert adapter.match(second[0, :45]).pages == 5
    adapter.close()
    engine.close()


def test_a_branch_point_gets_a_checkpoint_and_the_next_prompt_hits_it(model):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    adapter = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    system = tokens(24, seed=20)  # three pages every prompt shares
    first = torch.cat([system, tokens(13, seed=21)], dim=1)
    run = adapter.prefill(model, first)
    assert run.checkpoints == (4,)  # the end only: nothing else was cached
    adapter.flush()

    # The second shares 3 pages of KV but there is no state after them: a miss whose
    # match says how far the KV went, so the prefill also keeps the state at page 3.
    second = torch.cat([system, tokens(20, seed=22)], dim=1)
    run = adapter.prefill(model, second)
    assert (run.loaded_tokens, run.load.match.kv_pages, run.checkpoints) == (0, 3, (3, 5))
    assert run.store.result().checkpoints == (3, 5)

    # The third loads the branch point (and keeps its own end, 8 tokens into the pass).
    third = torch.cat([system, tokens(9, seed=23)], dim=1)
    run = adapter.prefill(model, third)
    assert (run.loaded_tokens, run.checkpoints) == (24, (4,))
    kept = continued(model, captured(model, second, 24), third[:, 24:], cuts=(8,))
    assert torch.equal(run.logits, kept)
    adapter.close()
    engine.close()


def test_a_prompt_ending_on_a_page_boundary_hits_when_repeated(model):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    adapter = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    prompt = tokens(32, seed=8)
    # The last token is always computed, so a repeat can load at most 3 of the 4 pages:
    # the one pass keeps the state after page 3 as well as after page 4.
    first = adapter.prefill(model, prompt)
    assert (first.chunks, first.checkpoints) == ((32,), (3, 4))
    assert first.store.result().checkpoints == (3, 4)
    again = adapter.prefill(model, prompt)
    assert (again.loaded_tokens, again.chunks) == (24, (8,))
    assert torch.equal(again.logits, continued(model, captured(model, prompt, 24), prompt[:, 24:]))
    torch.testing.assert_close(again.logits, first.logits[:, 24:], atol=1e-4, rtol=0)
    adapter.close()
    engine.close()


def test_store_of_a_partial_page_keeps_pages_but_no_checkpoint(model):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    adapter = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    prompt = tokens(37, seed=9)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    # The state after 37 tokens belongs to no page boundary: it must not be stored.
    stored = adapter.store(prompt[0], cache)
    assert (stored.stored, stored.checkpoints) == (4, ())
    match = adapter.match(prompt[0])
    assert (match.pages, match.kv_pages, match.stop) == (0, 4, StopReason.NO_CHECKPOINT)
    with pytest.raises(ValueError, match="seen 37 tokens but 36"):
        adapter.store(prompt[0, :36], cache)
    adapter.close()
    engine.close()


def test_staging_carved_from_one_allocation_round_trips(model):
    # What a GPU worker registers (one allocation for every buffer, so a CUDA IPC handle
    # exposes nothing else), built here on the CPU and given to an in-process engine.
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    spec = CacheSpec.probe(model, lambda: transformers.DynamicCache(config=model.config))
    layout = spec.layout(PAGE, ADAPTER.rows, ADAPTER.slots)
    buffers = device_buffers(layout, torch.device("cpu"))
    assert len({t.untyped_storage().data_ptr() for t in buffers.values()}) == 1
    worker = EmbeddedClient(engine).register(ADAPTER.model_id, layout, buffers=buffers)
    adapter = HybridCacheAdapter(worker, spec, ADAPTER, lambda: transformers.DynamicCache(
        config=model.config), "cpu")
    first = tokens(37, seed=12)
    adapter.prefill(model, first)
    adapter.flush()
    second = torch.cat([first[:, :32], tokens(6, seed=13)], dim=1)
    run = adapter.prefill(model, second)
    assert (run.loaded_tokens, run.chunks) == (32, (6,))
    assert torch.equal(run.logits, continued(model, captured(model, first, 32), second[:, 32:]))

    # A worker registered with another layout (here: fewer rows) is refused by name.
    small = EmbeddedClient(engine).register(ADAPTER.model_id, spec.layout(PAGE, 4))
    with pytest.raises(ValueError, match="another layout"):
        HybridCacheAdapter(small, spec, ADAPTER, lambda: None, "cpu")
    adapter.close()
    engine.close()


def test_last_only_keeps_the_last_logits_and_prompts_under_a_page_miss(model):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    adapter = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    prompt = tokens(21, seed=14)
    run = adapter.prefill(model, prompt, last_only=True)
    assert run.logits.shape == (1, 1, VOCAB) and run.computed_tokens == 21
    torch.testing.assert_close(run.logits, full_prefill(model, prompt)[:, -1:], atol=1e-4, rtol=0)
    adapter.flush()
    # Under one full page there is no key to ask for: a miss without a call.
    short = adapter.prefill(model, tokens(5, seed=15))
    assert (short.loaded_tokens, short.chunks, short.store) == (0, (5,), None)
    assert adapter.match(tokens(5, seed=15)).pages == 0
    adapter.close()
    engine.close()


def test_layers_that_drop_tokens_are_refused():
    layer = transformers.cache_utils.DynamicSlidingWindowLayer(sliding_window=4)
    cache = transformers.cache_utils.Cache(layers=[layer])
    cache.update(torch.zeros(1, 1, 6, 4), torch.zeros(1, 1, 6, 4), 0)
    with pytest.raises(UnsupportedCache, match="DynamicSlidingWindowLayer"):
        CacheSpec.of(cache)


def test_tiercache_imports_without_transformers():
    # Blocking the module makes `import transformers` fail as if it were not installed.
    root = os.path.dirname(os.path.dirname(tiercache.__file__))  # this checkout, not another
    code = (f"import sys; sys.path.insert(0, {root!r}); sys.modules['transformers'] = None\n"
            "import tiercache.engine, tiercache.integrations\n"
            "try:\n    import tiercache.integrations.transformers\n"
            "except ImportError as error:\n    print(error)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'tiercache[transformers]'" in out.stdout
