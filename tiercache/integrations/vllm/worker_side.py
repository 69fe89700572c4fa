"""The worker's half of the connector: this rank's KV cache groups registered with the
daemon, and the scheduler's jobs run against them.

Every cache group of the rank is a registration (pages.member_plans) and a rank of the
engine's group in the daemon, so a Match by the scheduler answers for every rank and
cache group at once. Buffers are vLLM's own memory (CUDA IPC on a GPU; on the CPU, views
into a shared region): loads and saves are the daemon's batched row copies, with no
staging copy here.

Loads run when vLLM starts them (`start`); on a GPU the daemon replies at once with an
event that vLLM's stream waits on, and a load counts as finished once every event of it
has completed (`finished`). A load that delivers less than the job asked for, or fails,
is reported failed, and vLLM recomputes the request. Saves go to a thread of their own,
so a worker never waits for one before its next step; on a GPU the daemon's copies start
after an event recorded when vLLM's forward pass was queued. A save is reported once
every store of it has replied, successfully or not; only then does the scheduler let go
of the blocks it reads. Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from tiercache.client import Client, Worker
from tiercache.errors import TiercacheError
from tiercache.group import GroupMember
from tiercache.integrations.vllm.jobs import LoadJob, SaveJob, head, tail
from tiercache.integrations.vllm.pages import CacheShape, member_plans, member_tensors

log = logging.getLogger("tiercache.vllm")


@dataclass
class _Loading:
    events: list[Any] = field(default_factory=list)  # CUDA events of the copies, or none
    failed: bool = False


class BlockMover:
    def __init__(self, members: Mapping[int, Worker], shape: CacheShape, on_gpu: bool) -> None:
        self.members = dict(members)  # vLLM cache group index -> registration
        self.shape = shape
        self.on_gpu = on_gpu
        self._loading: dict[str, _Loading] = {}
        self._saves: queue.Queue[tuple[Sequence[SaveJob], Any] | None] = queue.Queue()
        self._saved: dict[int, bool] = {}
        self._lock = threading.Lock()
        self._saver = threading.Thread(target=self._save_loop, name="tiercache-saves", daemon=True)
        self._saver.start()

    @classmethod
    def register(cls, client: Client, model_id: str, shape: CacheShape, backing: torch.Tensor,
                 group_id: str, tp_rank: int, tp_size: int, extra: Sequence[str] = ()
                 ) -> "BlockMover":
        """Register every cache group of rank `tp_rank` as a rank of group `group_id`."""
        plans = member_plans(shape, tp_rank, tp_size)
        members: dict[int, Worker] = {}
        try:
            for position, plan in enumerate(plans):
                member = GroupMember(group_id, tp_rank * len(plans) + position, tp_size * len(plans))
                members[plan.group.index] = client.register(
                    model_id, plan.layout, extra_keys=extra,
                    buffers=member_tensors(backing, plan, shape.num_blocks), group=member)
        except BaseException:
            for worker in members.values():
                worker.close()
            raise
        return cls(members, shape, backing.is_cuda)

    # -- loads --------------------------------------------------------------------------
    def start(self, jobs: Sequence[LoadJob]) -> None:
        for job in jobs:
            loading = self._loading.setdefault(job.req_id, _Loading())
            try:
                loading.events += self._load(job)
            except TiercacheError as error:
                log.warning("tiercache load for request %s failed, vLLM recomputes it: %s",
                            job.req_id, error)
                loading.failed = True

    def _load(self, job: LoadJob) -> list[Any]:
        if job.problem:
            raise _Short(job.problem)
        events = []
        for index, blocks in job.kv_blocks.items():
            result = self.members[index].load(keys=tail(job.chain, job.start), kv_rows=blocks)
            events.append(result.done)
            if result.match.pages != len(blocks):
                raise _Short(f"{result.match.pages} of {len(blocks)} KV pages in cache group {index}")
        for index, block in job.state_blocks.items():
            result = self.members[index].load(keys=job.chain, slot=block)
            events.append(result.done)
            if result.match.pages != job.end:
                raise _Short(f"the state after {job.end} pages in cache group {index} (found "
                             f"{result.match.pages})")
        return [e for e in events if e is not None]

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose loads are done, those of them that failed); each once."""
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
            for job in jobs:
                try:
                    ok = self._save(job, ready)
                except TiercacheError as error:
                    log.warning("tiercache save for request %s failed: %s", job.req_id, error)
                    ok = False
                with self._lock:
                    self._saved[job.job_id] = ok
            self._saves.task_done()
        self._saves.task_done()

    def _save(self, job: SaveJob, ready: Any) -> bool:
        ok = True
        for index, blocks in job.kv_blocks.items():
            result = self.members[index].store(keys=head(job.chain, len(blocks)), kv_rows=blocks,
                                               ready=ready)
            ok &= result.skipped == 0 and result.stored + result.present == len(blocks)
        for index, states in job.states.items():
            for pages, block in states:  # each the end of its store: the daemon keeps it
                result = self.members[index].store(
                    keys=head(job.chain, pages), checkpoints={pages * self.shape.block_size: block},
                    ready=ready)
                ok &= pages in result.checkpoints
        return ok

    def drain(self) -> None:
        """Return once the saves queued so far are done."""
        self._saves.join()

    def close(self) -> None:
        self._saves.put(None)
        self._saver.join(timeout=60)
        for worker in self.members.values():
            worker.close()


class _Short(TiercacheError):
    """A load delivered less than its job promised: the whole request is recomputed."""
