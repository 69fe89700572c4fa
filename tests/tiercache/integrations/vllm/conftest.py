"""Fixtures of the connector tests: a daemon, and a spy on the scheduler's lookups."""

from __future__ import annotations

import time

import pytest

from tests.service.daemon import running_daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("daemon")) as (address, _):
        yield address


@pytest.fixture
def hits(monkeypatch):
    """Every answer the scheduler got from get_num_new_matched_tokens: (request, local, n,
    seconds the call took)."""
    from tiercache.integrations.vllm.connector import TiercacheConnector  # needs vLLM
    seen = []
    real = TiercacheConnector.get_num_new_matched_tokens

    def spy(self, request, num_computed_tokens):
        began = time.monotonic()
        answer = real(self, request, num_computed_tokens)
        seen.append((request.request_id, num_computed_tokens, answer[0], time.monotonic() - began))
        return answer
    monkeypatch.setattr(TiercacheConnector, "get_num_new_matched_tokens", spy)
    return seen
