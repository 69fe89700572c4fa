"""The transformers adapter on tiny random hybrid models (float32, CPU, no downloads).

The pivotal property: a prefix stored by one adapter, pushed to disk and loaded by a
fresh one continues bit-identically to the same prefix kept in memory, and within
float32 rounding of a full prefill.
"""

from __future__ import annotations

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
    PAGE, VOCAB, full_prefill, greedy, in_memory, tiny_qwen3_next, tokens)

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
    # 37 tokens: the prefill stops after page 4 (token 32), stores pages 1-4 and the
    # state there, then computes the last 5 tokens.
    first = tokens(37, seed=1)
    host = HostConfig(budget_bytes=MiB if push == "restart" else 12 * 1024)
    config = EngineConfig(host=host, disk=disk_config(tmp_path))
    engine = Engine.open(config)
    adapter = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    run = adapter.prefill(model, first)
    assert (run.loaded_tokens, run.chunks) == (0, (32, 5))

    # Push the entries out of the host: a restarted engine rebuilds its index from LMDB
    # alone; a small host demotes the coldest entries when another prompt needs room.
    if push == "restart":
        engine.close()
        engine = Engine.open(config)
    else:
        adapter.prefill(model, tokens(37, seed=2))

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
    # the same prefix kept in memory, within rounding of a full prefill.
    calls.clear()
    with torch.no_grad():
        ours = model(input_ids=second[:, 32:], past_key_values=restored.cache,
                     use_cache=True).logits
    assert calls == [13]
    kept = in_memory(model, second, [32, 13])
    assert torch.equal(ours, kept), f"max |delta| = {(ours - kept).abs().max()}"
    torch.testing.assert_close(ours, full_prefill(model, second)[:, 32:], atol=1e-4, rtol=0)

    # Greedy generation from a loaded cache matches generation from scratch.
    again = fresh.load(second[0, :-1])
    assert torch.equal(greedy(model, second, again.cache), greedy(model, second))
    engine.close()


def test_host_hit_at_a_checkpoint_prefills_exactly_the_rest(model, calls):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    adapter = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    first = tokens(37, seed=4)
    adapter.prefill(model, first)

    # The second prompt shares exactly the 4 stored pages, then has 6 tokens of its own:
    # one forward pass over those 6, from the host tier.
    second = torch.cat([first[:, :32], tokens(6, seed=5)], dim=1)
    calls.clear()
    run = adapter.prefill(model, second)
    assert (run.loaded_tokens, run.chunks) == (32, (6,))
    assert calls == [6]
    layout = adapter.layout
    assert run.load.match.page_tiers == (Tier.HOST,) * 4
    assert run.load.bytes_from == {Tier.HOST: 4 * layout.page_bytes + layout.checkpoint_bytes}
    assert run.stores == ()  # nothing new: the hit ends on the last full page
    assert torch.equal(run.logits, in_memory(model, second, [32, 6]))
    engine.close()


def test_prefill_checkpoints_every_n_pages(model, calls):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    config = AdapterConfig(model_id=ADAPTER.model_id, page_tokens=PAGE, max_tokens=128,
                           checkpoint_every=2)
    adapter = HybridCacheAdapter.for_model(model, engine, config)

    # 45 tokens, 5 full pages: passes end at the checkpoints after pages 2, 4 and 5.
    first = tokens(45, seed=6)
    run = adapter.prefill(model, first)
    assert run.chunks == (16, 16, 8, 5)
    assert [s.checkpoints for s in run.stores] == [(2,), (4,), (5,)]
    torch.testing.assert_close(run.logits, full_prefill(model, first), atol=1e-4, rtol=0)

    # A prompt that leaves the first one inside page 3 resumes at the page-2 checkpoint.
    second = torch.cat([first[:, :20], tokens(9, seed=7)], dim=1)
    calls.clear()
    run = adapter.prefill(model, second)
    assert (run.loaded_tokens, run.chunks) == (16, (8, 5))
    assert calls == [8, 5]
    assert torch.equal(run.logits[:, -5:], in_memory(model, second, [16, 8, 5]))
    engine.close()


def test_prefill_without_end_checkpoints_stops_only_where_it_checkpoints(model, calls):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    config = AdapterConfig(model_id=ADAPTER.model_id, page_tokens=PAGE, max_tokens=128,
                           checkpoint_every=2, checkpoint_ends=False)
    adapter = HybridCacheAdapter.for_model(model, engine, config)

    # 45 tokens: passes end at the checkpoints after pages 2 and 4, then at the prompt's end;
    # nothing is kept after page 5, which would need a pass of its own.
    first = tokens(45, seed=16)
    run = adapter.prefill(model, first)
    assert run.chunks == (16, 16, 13)
    assert [s.checkpoints for s in run.stores] == [(2,), (4,), ()]

    # A prompt that ends on a page boundary keeps its end for free: one pass after the hit.
    second = torch.cat([first[:, :32], tokens(8, seed=17)], dim=1)
    calls.clear()
    run = adapter.prefill(model, second)
    assert (run.loaded_tokens, run.chunks, calls) == (32, (8,), [8])
    assert [s.checkpoints for s in run.stores] == [(5,)]
    assert torch.equal(run.logits, in_memory(model, second, [16, 16, 8]))  # as computed
    engine.close()


def test_a_prompt_ending_on_a_page_boundary_hits_when_repeated(model):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    adapter = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    prompt = tokens(32, seed=8)
    # The last token is always computed, so a repeat can load at most 3 of the 4 pages:
    # the first run keeps a checkpoint after page 3 as well as after page 4.
    first = adapter.prefill(model, prompt)
    assert first.chunks == (24, 8)
    again = adapter.prefill(model, prompt)
    assert (again.loaded_tokens, again.chunks) == (24, (8,))
    assert torch.equal(again.logits, first.logits[:, 24:])
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
    assert (match.pages, match.stop) == (0, StopReason.NO_CHECKPOINT)
    with pytest.raises(ValueError, match="seen 37 tokens but 36"):
        adapter.store(prompt[0, :36], cache)
    engine.close()


def test_staging_carved_from_one_allocation_round_trips(model):
    # What a GPU worker registers (one allocation for every buffer, so a CUDA IPC handle
    # exposes nothing else), built here on the CPU and given to an in-process engine.
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    spec = CacheSpec.probe(model, lambda: transformers.DynamicCache(config=model.config))
    layout = spec.layout(PAGE, ADAPTER.max_pages)
    buffers = device_buffers(layout, torch.device("cpu"))
    assert len({t.untyped_storage().data_ptr() for t in buffers.values()}) == 1
    worker = EmbeddedClient(engine).register(ADAPTER.model_id, layout, buffers=buffers)
    adapter = HybridCacheAdapter(worker, spec, ADAPTER, lambda: transformers.DynamicCache(
        config=model.config), "cpu")
    first = tokens(37, seed=12)
    adapter.prefill(model, first)
    second = torch.cat([first[:, :32], tokens(6, seed=13)], dim=1)
    run = adapter.prefill(model, second)
    assert (run.loaded_tokens, run.chunks) == (32, (6,))
    assert torch.equal(run.logits, in_memory(model, second, [32, 6]))

    # A worker registered with another layout (here: fewer rows) is refused by name.
    small = EmbeddedClient(engine).register(ADAPTER.model_id, spec.layout(PAGE, 4))
    with pytest.raises(ValueError, match="another layout"):
        HybridCacheAdapter(small, spec, ADAPTER, lambda: None, "cpu")
    engine.close()


def test_last_only_keeps_the_last_logits_and_prompts_under_a_page_miss(model):
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    adapter = HybridCacheAdapter.for_model(model, engine, ADAPTER)
    prompt = tokens(21, seed=14)
    run = adapter.prefill(model, prompt, last_only=True)
    assert run.logits.shape == (1, 1, VOCAB) and run.computed_tokens == 21
    torch.testing.assert_close(run.logits, full_prefill(model, prompt)[:, -1:], atol=1e-4, rtol=0)
    # Under one full page there is no key to ask for: a miss without a call.
    short = adapter.prefill(model, tokens(5, seed=15))
    assert (short.loaded_tokens, short.chunks, short.stores) == (0, (5,), ())
    assert adapter.match(tokens(5, seed=15)).pages == 0
    engine.close()


# Other hybrid families whose caches are built from the same transformers layer classes:
# GDN like Qwen3-Next; attention and Mamba-2 in one layer; MLP-only (dummy) layers;
# short-conv layers with a conv state and no recurrent state.
OTHER_FAMILIES = {
    "Qwen3_5": dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4),
    "FalconH1": dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, mamba_d_ssm=32,
        mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8),
    "NemotronH": dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, mamba_num_heads=4,
        mamba_head_dim=8, ssm_state_size=8, n_groups=1, chunk_size=8,
        layers_block_type=["mamba", "attention", "mlp", "mamba"]),
    "Lfm2": dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, full_attn_idxs=[1, 3]),
}
CONFIG_CLASSES = {"Qwen3_5": "Qwen3_5TextConfig"}


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_other_hybrid_families_round_trip_bit_exactly(family):
    config_class = getattr(transformers, CONFIG_CLASSES.get(family, f"{family}Config"))
    torch.manual_seed(0)
    model_class = getattr(transformers, f"{family}ForCausalLM")
    model = model_class(config_class(**OTHER_FAMILIES[family])).eval()
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=MiB)))
    config = AdapterConfig(model_id=f"tiny-{family}", page_tokens=PAGE, max_tokens=64)
    adapter = HybridCacheAdapter.for_model(model, engine, config)
    assert adapter.layout.needs_pages and adapter.layout.needs_checkpoint
    first = tokens(29, seed=10)
    adapter.prefill(model, first)

    # A fresh adapter resumes after page 3 and matches the in-memory cache bit for bit.
    second = torch.cat([first[:, :26], tokens(6, seed=11)], dim=1)
    run = HybridCacheAdapter.for_model(model, engine, config).prefill(model, second)
    assert (run.loaded_tokens, run.chunks) == (24, (8,))
    assert torch.equal(run.logits, in_memory(model, second, [24, 8]))
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
