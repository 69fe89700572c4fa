"""Tensor-parallel groups in the daemon: a Match from any rank, or by group id from a
process with no buffers, answers what every rank can load, and 0 while a rank is missing.

One real daemon per module on a real socket; every rank is a registration of its own
(its own connection, as a TP worker process would be), with buffers in shared memory.
Each rank writes bytes of its own, so a load that came from the wrong rank would show.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.polling import eventually
from tests.service.daemon import running_daemon
from tiercache.client import Client
from tiercache.errors import FailedPrecondition, InvalidArgument, NotFound
from tiercache.group import GroupMember
from tiercache.results import StopReason
from tiercache.layout import BufferSpec, Layout

PAGE = 8
PAGES = 6
MODEL = "org/hybrid@rev"
TENANTS = """
[tenants.acme]
tokens = ["acme-token"]
[tenants.beta]
tokens = ["beta-token"]
"""


def attention(rank: int, size: int) -> Layout:  # KV pages only, as vLLM's attention group
    return Layout(PAGE, paged=(BufferSpec("attn.kv", 16, (PAGE, 4), "float32"),),
                  tp_rank=rank, tp_size=size)


def mamba(rank: int, size: int) -> Layout:  # states only, as one of vLLM's Mamba groups
    return Layout(PAGE, slots=(BufferSpec("ssm.state", 16, (16,), "float32"),),
                  tp_rank=rank, tp_size=size)


def tokens(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, PAGES * PAGE + 3).tolist()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    folder = tmp_path_factory.mktemp("groups")
    (folder / "tenants.toml").write_text(TENANTS)
    (folder / "tenants.toml").chmod(0o600)
    with running_daemon(folder / "data", "--tenants-file", str(folder / "tenants.toml")) as (a, _):
        yield a


def join(address: str, group: str, rank: int, size: int, layout: Layout, token="acme-token"):
    client = Client(address, timeout=10, token=token)
    return client.register(MODEL, layout, group=GroupMember(group, rank, size))


def fill(worker, value: float) -> None:
    """Every row of the worker's buffers: its own value, so sources tell apart."""
    for tensor in (*worker.paged.values(), *worker.slots.values()):
        tensor.fill_(value)


def store_kv(worker, prompt: list[int], pages: int) -> None:
    worker.store(prompt[:pages * PAGE], kv_rows=range(pages))


def store_state(worker, prompt: list[int], pages: int) -> None:
    worker.store(prompt[:pages * PAGE], checkpoints={pages * PAGE: 0})


def test_every_rank_must_have_kv_and_the_state_at_the_hit(daemon):
    # two TP ranks, each an attention member and a Mamba member: a group of 4
    members = [join(daemon, "engine-a", r * 2 + k, 4, (attention, mamba)[k](r, 2))
               for r in range(2) for k in range(2)]
    prompt = tokens(1)
    # the attention members hold KV for 6 pages on rank 0 and 5 on rank 1
    store_kv(members[0], prompt, 6)
    store_kv(members[2], prompt, 5)
    # states: rank 0 after 2, 4 and 5 pages; rank 1 after 2 and 3 pages
    for pages in (2, 4, 5):
        store_state(members[1], prompt, pages)
    for pages in (2, 3):
        store_state(members[3], prompt, pages)
    # every rank can load 2 pages: KV everywhere, a state at 2 on both Mamba members
    scheduler = Client(daemon, timeout=10, token="acme-token").group("engine-a")
    assert scheduler.complete and scheduler.page_tokens == PAGE
    hit = scheduler.match(prompt)
    assert (hit.pages, hit.tokens, hit.stop) == (2, 2 * PAGE, StopReason.NO_CHECKPOINT)
    # any rank answers the same for the whole group
    assert {m.match(prompt).pages for m in members} == {2}
    # rank 1 gets its state after 5 pages: the hit moves to 5 (rank 1's KV ends there)
    store_state(members[3], prompt, 5)
    assert scheduler.match(prompt).pages == 5
    # a member on its own layout loads what it stored, not another rank's bytes
    fill(members[0], 1.0)
    fill(members[2], 2.0)
    store_kv(members[0], tokens(2), 4)
    store_kv(members[2], tokens(2), 4)
    fill(members[0], 0.0)
    fill(members[2], 0.0)
    assert members[0].load(tokens(2), kv_rows=range(4, 8)).match.pages == 4
    assert members[2].load(tokens(2), kv_rows=range(4, 8)).match.pages == 4
    assert torch.all(members[0].paged["attn.kv"][4:8] == 1.0)
    assert torch.all(members[2].paged["attn.kv"][4:8] == 2.0)
    for member in members:
        member.close()


def test_a_missing_or_dead_rank_makes_the_hit_zero(daemon):
    rank0 = join(daemon, "engine-b", 0, 2, mamba(0, 2))
    prompt = tokens(3)
    store_state(rank0, prompt, 4)
    # rank 1 never registered: no hit, and the reason says why
    hit = rank0.match(prompt)
    assert (hit.pages, hit.stop) == (0, StopReason.GROUP_INCOMPLETE)
    # rank 1 comes and stores the same state: the group hits
    rank1 = join(daemon, "engine-b", 1, 2, mamba(1, 2))
    store_state(rank1, prompt, 4)
    assert rank0.match(prompt).pages == 4
    # rank 1's process goes away (its registration ends): 0 again, never a partial hit
    rank1.close()
    # the daemon notices a closed registration stream a moment after the client
    assert eventually(lambda: rank0.match(prompt).stop == StopReason.GROUP_INCOMPLETE)
    scheduler = Client(daemon, timeout=10, token="acme-token").group("engine-b")
    assert scheduler.live_ranks == (0,) and not scheduler.complete
    assert scheduler.match(prompt).pages == 0
    # a restarted rank 1 takes its rank back and finds its entries where it left them
    rank1 = join(daemon, "engine-b", 1, 2, mamba(1, 2))
    assert scheduler.match(prompt).pages == 4
    rank0.close()
    rank1.close()


def test_ranks_that_do_not_fit_the_group_are_refused(daemon):
    rank0 = join(daemon, "engine-c", 0, 2, attention(0, 2))
    # a second live worker for rank 0 (two engines under one id)
    with pytest.raises(FailedPrecondition, match="held by a live worker"):
        join(daemon, "engine-c", 0, 2, attention(0, 2))
    # another group size, another model
    with pytest.raises(FailedPrecondition, match="has 2 ranks"):
        join(daemon, "engine-c", 1, 3, attention(1, 3))
    with pytest.raises(FailedPrecondition, match="model"):
        Client(daemon, timeout=10, token="acme-token").register(
            "other/model", attention(1, 2), group=GroupMember("engine-c", 1, 2))
    # rank 1 with rank 0's layout would share its entries
    with pytest.raises(InvalidArgument, match="same layout"):
        join(daemon, "engine-c", 1, 2, attention(0, 2))
    # a bad rank never reaches the daemon; a group nobody joined is not found
    with pytest.raises(InvalidArgument, match="rank"):
        GroupMember("engine-c", 2, 2)
    with pytest.raises(NotFound, match="no rank"):
        Client(daemon, timeout=10, token="acme-token").group("engine-none")
    rank0.close()


def test_a_group_is_seen_only_by_its_own_tenant(daemon):
    rank0 = join(daemon, "engine-d", 0, 1, mamba(0, 1))
    prompt = tokens(4)
    store_state(rank0, prompt, 3)
    assert Client(daemon, timeout=10, token="acme-token").group("engine-d").match(prompt).pages == 3
    # beta asks for acme's group id: no such group in beta's tenant
    with pytest.raises(NotFound):
        Client(daemon, timeout=10, token="beta-token").group("engine-d")
    # beta's own group of the same id and layout does not hit acme's entries
    beta = join(daemon, "engine-d", 0, 1, mamba(0, 1), token="beta-token")
    assert beta.match(prompt).pages == 0
    beta.close()
    rank0.close()
