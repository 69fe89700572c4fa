"""The connector against vLLM 0.32's real scheduler on the CPU, with a real daemon.

Each test runs requests through `harness.Engine`: vLLM's Scheduler with the connector it
loads from kv_transfer_config, the connector's worker role over vLLM's own views of a
shared-memory KV cache, and a stand-in model that checks, before every forward pass,
that each KV page and Mamba state it would read holds exactly what computing the prefix
would have produced (see harness). Skipped where vLLM is not installed (`make test-vllm`
runs these in a virtual environment of their own).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from tests.tiercache.integrations.vllm.harness import (BLOCK, engine, prompt,  # noqa: E402
                                                       vllm_config)
from tests.polling import eventually  # noqa: E402
from tiercache.client import Client  # noqa: E402
from tiercache.results import StopReason  # noqa: E402


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])  # layer-outer, block-outer
def test_an_aligned_hit_loads_into_new_blocks_and_the_model_reads_exact_state(
        daemon, tmp_path, hits, layout):
    client = Client(daemon)
    run = engine(vllm_config(tmp_path, daemon, layout=layout), 64, client)
    tokens = prompt(1, 87)  # 5 full blocks and 7 tokens
    # request a computes the prompt in chunks; the connector saves KV and offered states
    run.add("a", tokens)
    run.run()
    assert run.mismatches == []
    # vLLM forgets its own prefix cache: only tiercache holds the prefix now
    assert run.scheduler.reset_prefix_cache()
    run.add("b", tokens)
    run.run()
    # b was told of a hit at the deepest block boundary below the prompt's last token
    assert [(local, n) for req, local, n, _ in hits if req == "b"] == [(0, 80)]
    assert all(n % BLOCK == 0 for _, _, n, _ in hits)
    # b's first forward pass started from the loaded prefix, and read it exactly right
    assert run.starts["b"][0] == 80
    assert run.mismatches == []
    assert run.finished == {"a": "length", "b": "length"}
    assert client.stats().counters["loaded_pages"] >= 5
    run.close()


def test_hits_end_on_a_block_boundary_with_a_state_below_the_prompts_last_token(
        daemon, tmp_path, hits):
    client = Client(daemon)
    run = engine(vllm_config(tmp_path, daemon), 64, client)
    a, whole = prompt(2, 87), prompt(3, 96)  # 5 blocks and 7 tokens; exactly 6 blocks
    # vLLM offers the state at the last block boundary before a prompt's last token:
    # a gives the state after 80 tokens, whole after 80, whole + 5 tokens after 96
    for req_id, tokens in (("a", a), ("whole", whole), ("longer", whole + prompt(6, 5))):
        run.add(req_id, tokens)
    run.run()
    group = Client(daemon).group(run.scheduler.connector.group_id)
    assert group.match(whole).pages == 6  # every page of `whole` and the state after it
    assert run.scheduler.reset_prefix_cache()
    # shares 85 tokens with a: the hit is the 80 that end on a block boundary with a state
    run.add("shares-85", a[:85] + prompt(4, 20))
    # the whole prompt is cached, but vLLM must compute its last token: 80, not 96
    run.add("whole-again", whole)
    # a's first 4 KV pages match, but there is no state after them: no hit at all
    kv_only = a[:64] + prompt(5, 20)
    assert group.match(kv_only).stop == StopReason.NO_CHECKPOINT  # KV there, no state
    run.add("kv-only", kv_only)
    run.run()
    answers = {req: n for req, _, n, _ in hits}
    assert answers["shares-85"] == 80 and answers["whole-again"] == 80
    assert answers["kv-only"] == 0
    assert all(n % BLOCK == 0 for _, _, n, _ in hits)
    assert run.starts["shares-85"][0] == 80 and run.starts["whole-again"][0] == 80
    assert run.mismatches == []
    assert set(run.finished.values()) == {"length"} and len(run.finished) == 6
    run.close()


def test_preempted_requests_resume_exactly_and_every_pinned_block_is_released(
        daemon, tmp_path, hits):
    client = Client(daemon)
    # 30 blocks for three requests of 100 prompt and 40 output tokens: vLLM preempts
    run = engine(vllm_config(tmp_path, daemon), 30, client)
    requests = [run.add(f"r{i}", prompt(10 + i, 100), max_tokens=40) for i in range(3)]
    pool = run.scheduler.kv_cache_manager.block_pool
    held = 0
    while run.scheduler.has_requests() or run.scheduler.connector.has_pending_push_work():
        run.step(drain_saves=False)  # saves finish on their thread, reported steps later
        held += run.scheduler.connector.has_pending_push_work()
        assert run.steps < 400
    assert sum(r.num_preemptions for r in requests) >= 1
    # resumed requests asked the connector again and read exact KV and state
    assert {req for req, *_ in hits} == {"r0", "r1", "r2"} and len(hits) > 3
    assert run.mismatches == []
    assert run.finished == {"r0": "length", "r1": "length", "r2": "length"}
    # saves held blocks across steps, and every one was given back
    assert held > 0
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1  # all but the null block
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    run.close()


def test_a_tp_group_hits_only_where_every_rank_has_kv_and_state(daemon, tmp_path, hits,
                                                               monkeypatch):
    client = Client(daemon)
    # two TP ranks, each with its own KV cache (its own bytes), one scheduler
    run = engine(vllm_config(tmp_path, daemon, tp=2), 64, client, ranks=2, monkeypatch=monkeypatch)
    tokens = prompt(20, 87)
    run.add("a", tokens)
    run.run()
    group = Client(daemon).group(run.scheduler.connector.group_id)
    assert group.size == 2 * 3 and group.complete  # 2 ranks x 3 KV cache groups
    assert group.match(tokens).pages == 5
    # rank 1 loses the state after 80 tokens in one of its Mamba groups
    chain = group.chain(tokens[:80])
    rank1 = run.ranks[1].connector.mover.members()
    assert rank1[2].evict(keys=chain.keys[-1:]) == 1
    assert run.scheduler.reset_prefix_cache()
    run.add("b", tokens)
    run.run()
    # rank 0 could have loaded 80 tokens, rank 1 not: no hit, b computed everything itself
    assert [n for req, _, n, _ in hits if req == "b"] == [0]
    assert run.starts["b"][0] == 0 and run.mismatches == []
    # b stored the state again on both ranks; then rank 1's worker goes away
    assert group.match(tokens).pages == 5
    run.ranks.pop().connector.shutdown()
    assert eventually(lambda: group.match(tokens).stop == StopReason.GROUP_INCOMPLETE)
    assert run.scheduler.reset_prefix_cache()
    c = Request("c", tokens, SamplingParams(max_tokens=2), None,
                block_hasher=get_request_block_hasher(BLOCK, sha256))
    # a rank is missing: the lookup says 0, not 80
    assert run.scheduler.connector.get_num_new_matched_tokens(c, 0) == (0, False)
    run.close()


def test_kv_events_announce_what_the_daemon_holds_and_hits_are_split_by_tier(
        daemon, tmp_path, hits, monkeypatch):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from tiercache.integrations.vllm.connector import TiercacheConnector
    run = engine(vllm_config(tmp_path, daemon), 64, Client(daemon))
    published, sources = [], []
    monkeypatch.setattr(run.scheduler.kv_event_publisher, "publish",
                        lambda batch: published.extend(batch.events))
    real = TiercacheConnector.get_external_cache_hit_sources
    monkeypatch.setattr(TiercacheConnector, "get_external_cache_hit_sources",
                        lambda self, r, n: sources.append((r.request_id, real(self, r, n)))
                        or sources[-1][1])
    tokens = prompt(50, 87)
    a = run.add("a", tokens)
    run.run()
    hashes = [maybe_convert_block_hash(h) for h in a.block_hashes[:5]]
    ours = [e for e in published if isinstance(e, BlockStored) and e.medium == "CPU"]
    # attention: blocks 1..5 with vLLM's hashes, token ids and parents, in daemon memory
    kv = [e for e in ours if e.group_idx == 0]
    assert [h for e in kv for h in e.block_hashes] == hashes
    assert [t for e in kv for t in e.token_ids] == tokens[:80] and kv[0].parent_block_hash is None
    assert {e.kv_cache_spec_kind for e in kv} == {"full_attention"}
    # each Mamba group: the state after 80 tokens, as the block ending there
    for group in (1, 2):
        [state] = [e for e in ours if e.group_idx == group]
        assert (state.block_hashes, state.parent_block_hash, state.token_ids,
                state.kv_cache_spec_kind) == ([hashes[4]], hashes[3], tokens[64:80], "mamba")
    # b hits all 80 tokens from the daemon's host memory
    assert run.scheduler.reset_prefix_cache()
    run.add("b", tokens)
    run.run()
    assert sources == [("b", {CacheHitSource.HOST: 80})]
    # a longer prompt stores a sixth page (and the state after it); then the daemon loses
    # that page: the next lookup stops at the fifth, and says the sixth is gone
    longer = run.add("longer", tokens + prompt(51, 14))
    run.run()
    sixth = maybe_convert_block_hash(longer.block_hashes[5])
    assert any(sixth in e.block_hashes for e in published if isinstance(e, BlockStored))
    group = Client(daemon).group(run.scheduler.connector.group_id)
    attention = run.ranks[0].connector.mover.members()[0]
    assert attention.evict(keys=group.chain(longer.all_token_ids[:96]).keys[5:]) == 1
    published.clear()
    assert run.scheduler.reset_prefix_cache()
    run.add("c", list(longer.prompt_token_ids))
    run.step()
    removed = [e for e in published if isinstance(e, BlockRemoved)]
    assert [(e.block_hashes, e.group_idx, e.medium) for e in removed] == [([sixth], 0, "CPU")]
    run.close()
