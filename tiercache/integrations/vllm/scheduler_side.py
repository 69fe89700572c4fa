"""The scheduler's half of the connector: what counts as a hit, what to load and save,
and which blocks to hold until every worker is done with them.

A hit of L tokens is reported only when every rank of the engine can load it: the
daemon's group match requires KV pages 1..L/B on every attention member and a state at
exactly L on every Mamba member (B, the block size, is the page size). L is a multiple
of B, at most prompt - 1 tokens (vLLM must compute the last token; a hit covering the
whole prompt trips an assertion in its scheduler), and beyond what vLLM found in its own
prefix cache; vLLM's own hit must end on a block boundary (it does when it reaches us).
Loads are asynchronous: vLLM keeps the request waiting until every rank reports it
loaded, and recomputes it when one reports a failure (the only failure report vLLM
accepts for models with several KV cache groups).

Saves: attention KV by position from the append-only block table (full blocks only);
Mamba state only from the boundary states vLLM offers in the step it offers them
(`kv_connector_block_state.boundary_state_offloads`): the Mamba block table is not
append-only, and reading it by position stores a stale state under a valid key. Every
block a save reads gets a reference (`BlockPool.touch`) until all ranks report the
save, so neither a finished request nor a preemption hands it to another request first.

The daemon is asked within `match_timeout`; a daemon that is down or slow costs that
once, then no lookups for `retry_after` seconds: vLLM goes on without the cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from tiercache.client import Client
from tiercache.errors import TiercacheError
from tiercache.group import Group
from tiercache.hashing import HASHES, Chain, PageKey, page_chain
from tiercache.results import Match
from tiercache.integrations.vllm.config import ConnectorConfig
from tiercache.integrations.vllm.jobs import Jobs, LoadJob, SaveJob, SaveReport, head
from tiercache.integrations.vllm.pages import ATTENTION, MAMBA, CacheShape

log = logging.getLogger("tiercache.vllm")


@dataclass(frozen=True)
class Hit:
    local: int  # tokens vLLM holds itself
    pages: int  # pages every rank can load
    match: Match


@dataclass
class Tracked:
    request: Any  # vllm.v1.request.Request
    root: PageKey | None = None  # the group's root, or one derived for a salt or LoRA
    chain: Chain | None = None  # pages hashed so far
    saved: int = 0  # attention pages handed to save jobs
    hit: Hit | None = None  # the last answer of get_num_new_matched_tokens


@dataclass
class Pinned:
    request: Any  # kept for its announcement: it may finish before its saves are done
    blocks: list[int]
    waiting: int  # ranks yet to report the save
    job: SaveJob
    first: int  # the first attention page this job saves that no job before it did
    ok: bool = True


class Events(Protocol):
    """Where saves and misses are announced (events.Announcer: vLLM's KV events)."""

    def saved(self, request: Any, job: SaveJob, first: int) -> None: ...
    def missed(self, request: Any, match: Match, asked: int) -> None: ...


class NoEvents:
    def saved(self, request: Any, job: SaveJob, first: int) -> None:
        pass

    def missed(self, request: Any, match: Match, asked: int) -> None:
        pass


@dataclass
class SchedulerSide:
    config: ConnectorConfig
    shape: CacheShape
    group_id: str
    ranks: int  # worker processes that each report every save
    events: Events = field(default_factory=NoEvents)
    pool: Any = None  # vLLM's BlockPool, bound after construction
    requests: dict[str, Tracked] = field(default_factory=dict)
    loads: list[LoadJob] = field(default_factory=list)
    loading: set[str] = field(default_factory=set)
    pins: dict[int, Pinned] = field(default_factory=dict)
    _client: Client | None = None
    _group: Group | None = None
    _retry_at: float = 0.0
    _next_job: int = 0

    # -- lookups ------------------------------------------------------------------------
    def matched_tokens(self, request: Any, local: int) -> tuple[int, bool]:
        tracked = self.track(request)
        tracked.hit = None
        bs = self.shape.block_size
        pages = (request.num_tokens - 1) // bs  # never the whole prompt
        if not _cacheable(request) or local % bs or pages * bs <= local:
            return 0, False
        match = self._match(tracked, pages)
        if match is not None and match.pages < pages:
            self.events.missed(request, match, pages)
        if match is None or match.tokens <= local:
            return 0, False
        tracked.hit = Hit(local, match.pages, match)
        return match.tokens - local, True

    def _match(self, tracked: Tracked, pages: int) -> Match | None:
        group = self._described()
        if group is None:
            return None
        try:
            return group.match(keys=self._chain(tracked, pages))
        except TiercacheError as error:
            self._failed(error)
            return None

    def _described(self) -> Group | None:
        if self._group is None and time.monotonic() >= self._retry_at:
            try:
                self._client = self._client or self.config.client()
                self._group = self._client.group(self.group_id, timeout=self.config.match_timeout)
            except TiercacheError as error:
                self._failed(error)
        return self._group

    def _failed(self, error: TiercacheError) -> None:
        if self._retry_at <= time.monotonic():
            log.warning("tiercache lookups pause for %.1f s, vLLM goes on without the cache: %s",
                        self.config.retry_after, error)
        self._retry_at = time.monotonic() + self.config.retry_after
        if self._client is not None:  # a channel that failed backs off reconnecting: a new one
            self._client.close()
        self._client = self._group = None

    def _chain(self, tracked: Tracked, pages: int) -> Chain:
        """The request's first `pages` page keys, hashed once and extended as it grows."""
        group = self._group
        assert group is not None
        if tracked.root is None:
            tracked.root = _root_of(tracked.request, group)
            tracked.chain = Chain([], np.empty(0, np.uint64))
        chain = tracked.chain
        assert chain is not None
        have, bs = len(chain.keys), self.shape.block_size
        if pages > have:
            tokens = tracked.request.all_token_ids[have * bs:pages * bs]
            more = page_chain(list(tokens), chain.keys[-1] if have else tracked.root, bs,
                              group.hash_name)
            checks = np.concatenate([chain.checks, more.checks]).astype(np.uint64)
            chain = tracked.chain = Chain(chain.keys + more.keys, checks)
        return head(chain, pages)

    # -- loads --------------------------------------------------------------------------
    def plan_load(self, request: Any, block_ids: Sequence[Sequence[int]], external: int) -> None:
        if external == 0:
            return
        tracked = self.track(request)
        hit, bs = tracked.hit, self.shape.block_size
        assert hit is not None, "vLLM allocated external tokens the connector did not report"
        end_tokens = hit.local + external
        start, end = hit.local // bs, end_tokens // bs
        kv = {g.index: tuple(block_ids[g.index][start:end])
              for g in self.shape.groups if g.kind == ATTENTION}
        states = {g.index: block_ids[g.index][end - 1]
                  for g in self.shape.groups if g.kind == MAMBA}
        problem = ""
        if end_tokens % bs or end > hit.pages:
            problem = f"vLLM asked for {external} tokens after {hit.local}, not the hit's end"
        elif any(len(b) != end - start or 0 in b for b in kv.values()) or 0 in states.values():
            problem = "vLLM gave null or missing blocks for the loaded pages"
        self.loads.append(LoadJob(request.request_id, self._chain(tracked, end), start, kv,
                                  states, problem))
        self.loading.add(request.request_id)

    # -- saves --------------------------------------------------------------------------
    def build(self, output: Any) -> Jobs:
        loads, self.loads = tuple(self.loads), []
        state = output.kv_connector_block_state
        saves = []
        if state is not None and self._described() is not None:
            offers = state.boundary_state_offloads
            for req_id in state.req_ids | set(offers):
                tracked = self.requests.get(req_id)
                if tracked is None or not _cacheable(tracked.request):
                    continue
                job = self._save_job(tracked, state.get_block_ids(req_id),
                                     output.num_scheduled_tokens.get(req_id, 0),
                                     offers.get(req_id, ()))
                if job is not None:
                    saves.append(job)
        return Jobs(loads, tuple(saves))

    def _save_job(self, tracked: Tracked, block_ids: Any, scheduled: int,
                  offers: Sequence[tuple[int, int, int]]) -> SaveJob | None:
        request, bs = tracked.request, self.shape.block_size
        done = min(request.num_computed_tokens + scheduled, request.num_tokens)
        full, kv = done // bs, {}
        if block_ids is not None and full > tracked.saved:
            kv = {g.index: tuple(block_ids[g.index][:full])
                  for g in self.shape.groups if g.kind == ATTENTION}
            if any(len(b) < full or 0 in b for b in kv.values()):
                kv = {}  # not a full-attention table: nothing to save by position
        states: dict[int, list[tuple[int, int]]] = {}
        kinds = {g.index: g.kind for g in self.shape.groups}
        for index, block, boundary in offers:
            if kinds.get(index) == MAMBA and block and boundary % bs == 0 and 0 < boundary <= done:
                states.setdefault(index, []).append((boundary // bs, block))
        if not kv and not states:
            return None
        pages = max([full if kv else 0] + [p for s in states.values() for p, _ in s])
        job = SaveJob(self._next_job, request.request_id, self._chain(tracked, pages), kv,
                      {i: tuple(s) for i, s in states.items()})
        self._next_job += 1
        first = tracked.saved
        tracked.saved = max(tracked.saved, full if kv else 0)
        blocks = job.blocks()
        self.pool.touch([self.pool.blocks[b] for b in blocks])
        self.pins[job.job_id] = Pinned(request, blocks, self.ranks, job, first)
        return job

    def reported(self, report: SaveReport | None, finished_loading: set[str]) -> None:
        """Workers' reports of one step: release what every rank is done with."""
        self.loading -= finished_loading
        for job_id, (ranks, ok) in (report.done.items() if report else ()):
            pinned = self.pins.get(job_id)
            if pinned is None:
                continue
            pinned.waiting -= ranks
            pinned.ok &= ok
            if pinned.waiting > 0:
                continue
            del self.pins[job_id]
            # tail first, as vLLM frees: the shared prefix is evicted last
            self.pool.free_blocks(self.pool.blocks[b] for b in reversed(pinned.blocks))
            if pinned.ok:
                self.events.saved(pinned.request, pinned.job, pinned.first)

    # -- requests -----------------------------------------------------------------------
    def track(self, request: Any) -> Tracked:
        tracked = self.requests.get(request.request_id)
        if tracked is None:
            tracked = self.requests[request.request_id] = Tracked(request)
        return tracked

    def finished(self, request: Any) -> bool:
        """Forget a finished request; True while a load still writes its blocks (vLLM
        frees them once every rank reports the load)."""
        self.requests.pop(request.request_id, None)
        return request.request_id in self.loading


def _cacheable(request: Any) -> bool:
    """Requests whose KV depends only on their token ids (and a salt or LoRA, which get
    roots of their own): not multimodal inputs or prompt embeddings."""
    return not request.mm_features and request.prompt_token_ids is not None


def _root_of(request: Any, group: Group) -> PageKey:
    extra = []
    if request.lora_request is not None:
        extra.append(f"lora:{request.lora_request.lora_name}")
    if request.cache_salt:
        extra.append(f"salt:{request.cache_salt}")
    if not extra:
        return group.root
    return PageKey(HASHES[group.hash_name](group.root + "\0".join(extra).encode()))
