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

from tests.service.daemon import running_daemon  # noqa: E402
from tests.tiercache.integrations.vllm.harness import (BLOCK, engine, prompt,  # noqa: E402
                                                       vllm_config)
from tiercache.client import Client  # noqa: E402


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("daemon")) as (address, _):
        yield address


@pytest.fixture
def hits(monkeypatch):
    """Every answer the scheduler got from get_num_new_matched_tokens: (request, local, n)."""
    from tiercache.integrations.vllm.connector import TiercacheConnector
    seen = []
    real = TiercacheConnector.get_num_new_matched_tokens

    def spy(self, request, num_computed_tokens):
        answer = real(self, request, num_computed_tokens)
        seen.append((request.request_id, num_computed_tokens, answer[0]))
        return answer
    monkeypatch.setattr(TiercacheConnector, "get_num_new_matched_tokens", spy)
    return seen


def test_an_aligned_hit_loads_into_new_blocks_and_the_model_reads_exact_state(
        daemon, tmp_path, hits):
    client = Client(daemon)
    run = engine(vllm_config(tmp_path, daemon), 64, client)
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
    assert ("b", 0, 80) in hits
    assert all(n % BLOCK == 0 for _, _, n in hits)
    # b's first forward pass started from the loaded prefix, and read it exactly right
    assert run.starts["b"][0] == 80
    assert run.mismatches == []
    assert run.finished == {"a": "length", "b": "length"}
    assert client.stats().counters["loaded_pages"] >= 5
    run.close()
