"""The worker's half of the connector: this rank's KV cache groups registered with the
daemon, and the scheduler's jobs run against them.

Every cache group of the rank is a registration (pages.member_plans) and a rank of the
engine's group in the daemon, so a Match by the scheduler answers for every rank and
cache group at once. Buffers are vLLM's own memory (CUDA IPC on a GPU; on the CPU, views
into a shared region): loads and saves are the daemon's batched row copies, with no
staging copy here.

Loads run when vLLM starts them (`start`); on a GPU the daemon replies at once with an
event that vLLM's stream waits on, and a load counts as finished once every event of it
has completed (`finished`). A load that delivers less than its job asked for, fails, or
was in flight when the registration was lost, is reported failed, and vLLM recomputes
the request. Saves go to a thread of their own, so a worker never waits for one before
its next step; on a GPU the daemon's copies start after an event recorded when vLLM's
forward pass was queued. A save is reported once every store of it has replied, stored
or not; only then does the scheduler let go of the blocks it reads.

A daemon that is down at start, or goes away, costs no crash: jobs fail (vLLM computes
without the cache) and the worker registers again once it answers, at most every
`retry_after` seconds. Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from tiercache.client import Client, Worker
from tiercache.errors import TiercacheError
from tiercache.group import GroupMember
from tiercache.integrations.vllm.jobs import LoadJob, SaveJob, head, tail
from tiercache.integrations.vllm.pages import CacheShape, member_plans, member_tensors

log = logging.getLogger("tiercache.vllm")

Members = Mapping[int, Worker]  # vLLM cache group index -> registration


@dataclass(frozen=True)
class Registrar:
    """How this rank registers its cache groups (again, after the daemon comes back)."""

    client: Callable[[], Client]
    model_id: str
    group_id: str
    tp_rank: int
    tp_size: int
    extra: tuple[str, ...] = ()

    def register(self, shape: CacheShape, backing: torch.Tensor
                 ) -> tuple[Client, dict[int, Worker]]:
        plans = member_plans(shape, self.tp_rank, self.tp_size)
        client, members = self.client(), {}
        try:
            for position, plan in enumerate(plans):
                rank = self.tp_rank * len(plans) + position
                member = GroupMember(self.group_id, rank, self.tp_size * len(plans))
                members[plan.group.index] = client.register(
                    self.model_id, plan.layout, extra_keys=self.extra,
                    buffers=member_tensors(backing, plan, shape.num_blocks), group=member)
        except BaseException:
            for worker in members.values():
                worker.close()
            client.close()
            raise
        return client, members


@dataclass
class _Loading:
    events: list[Any] = field(default_factory=list)  # CUDA events of the copies, or none
    failed: bool = False


class BlockMover:
    def __init__(self, registrar: Registrar, shape: CacheShape, backing: torch.Tensor,
                 retry_after: float) -> None:
        self.registrar, self.shape, self.backing = registrar, shape, backing
        self.on_gpu = backing.is_cuda
        self._retry_after, self._retry_at = retry_after, 0.0
        self._members: dict[int, Worker] | None = None
        self._client: Client | None = None
        self._loading: dict[str, _Loading] = {}
        self._saves: queue.Queue[tuple[Sequence[SaveJob], Any] | None] = queue.Queue()
        self._saved: dict[int, bool] = {}
        self._lock = threading.Lock()
        self._saver = threading.Thread(target=self._save_loop, name="tiercache-saves", daemon=True)
        self._saver.start()

    def members(self) -> Members | None:
        """This rank's registrations, registering (again) if they are gone and it is time."""
        with self._lock:
            if self._members is not None and all(w.connected for w in self._members.values()):
                return self._members
            if self._members is not None:  # the daemon went away: what was loading is lost
                self._drop()
            if time.monotonic() < self._retry_at:
                return None
            try:
                self._client, self._members = self.registrar.register(self.shape, self.backing)
            except TiercacheError as error:
                log.warning("tiercache registration failed, vLLM runs without the cache for "
                            "%.1f s: %s", self._retry_after, error)
                self._retry_at = time.monotonic() + self._retry_after
            return self._members

    def _drop(self) -> None:
        assert self._members is not None
        for worker in self._members.values():
            worker.close()
        self._members = None
        if self._client is not None:
            self._client.close()
            self._client = None
        for loading in self._loading.values():
            loading.failed = True

    # -- loads --------------------------------------------------------------------------
    def start(self, jobs: Sequence[LoadJob]) -> None:
        members = self.members() if jobs else None
        for job in jobs:
            loading = self._loading.setdefault(job.req_id, _Loading())
            try:
                if members is None:
                    raise _Short("the daemon is not reachable")
                loading.events += _load(members, job)
            except TiercacheError as error:
                log.warning("tiercache load for request %s failed, vLLM recomputes it: %s",
                            job.req_id, error)
                loading.failed = True

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose loads are done, those of them that failed); each once."""
        if self._loading:
            self.members()  # a lost registration fails what was loading
        done = {req for req, loading in self._loading.items()
                if loading.failed or all(e.query() for e in loading.events)}
        failed = {req for req in done if self._loading[req].failed}
        for req in done:
            del self._loading[req]
        return done, failed

    # -- saves --------------------------------------------------------------------------
    def save(self, jobs: Sequence[SaveJob], ready: Any = None) -> None:
        """Queue save jobs; on a GPU, `ready` is an interprocess event recorded after
        the forward pass that wrote their blocks."""
        if jobs:
            self._saves.put((jobs, ready))

    def saved(self) -> dict[int, bool]:
        """Save jobs finished since the last call, and whether each stored everything."""
        with self._lock:
            saved, self._saved = self._saved, {}
        return saved

    def _save_loop(self) -> None:
        while (item := self._saves.get()) is not None:
            jobs, ready = item
            members = self.members()
            for job in jobs:
                try:
                    ok = members is not None and _save(members, self.shape, job, ready)
                except TiercacheError as error:
                    log.warning("tiercache save for request %s failed: %s", job.req_id, error)
                    ok = False
                with self._lock:
                    self._saved[job.job_id] = ok
            self._saves.task_done()
        self._saves.task_done()

    def drain(self) -> None:
        """Return once the saves queued so far are done."""
        self._saves.join()

    def close(self) -> None:
        self._saves.put(None)
        self._saver.join(timeout=60)
        with self._lock:
            if self._members is not None:
                self._drop()


def _load(members: Members, job: LoadJob) -> list[Any]:
    if job.problem:
        raise _Short(job.problem)
    events = []
    for index, blocks in job.kv_blocks.items():
        result = members[index].load(keys=tail(job.chain, job.start), kv_rows=blocks)
        events.append(result.done)
        if result.match.pages != len(blocks):
            raise _Short(f"{result.match.pages} of {len(blocks)} KV pages in cache group {index}")
    for index, block in job.state_blocks.items():
        result = members[index].load(keys=job.chain, slot=block)
        events.append(result.done)
        if result.match.pages != job.end:
            raise _Short(f"the state after {job.end} pages in cache group {index} (found "
                         f"{result.match.pages})")
    return [e for e in events if e is not None]


def _save(members: Members, shape: CacheShape, job: SaveJob, ready: Any) -> bool:
    """Synchronous stores: vLLM may hand a job's blocks to another request, on a stream of
    its own, once the job is reported saved."""
    ok = True
    for index, blocks in job.kv_blocks.items():
        result = members[index].store(keys=head(job.chain, len(blocks)), kv_rows=blocks,
                                      ready=ready, synchronous=True)
        ok &= result.skipped == 0 and result.stored + result.present == len(blocks)
    for index, states in job.states.items():
        for pages, block in states:  # each the end of its store: the daemon keeps it
            result = members[index].store(keys=head(job.chain, pages),
                                          checkpoints={pages * shape.block_size: block},
                                          ready=ready, synchronous=True)
            ok &= pages in result.checkpoints
    return ok


class _Short(TiercacheError):
    """A load delivered less than its job promised: the whole request is recomputed."""
