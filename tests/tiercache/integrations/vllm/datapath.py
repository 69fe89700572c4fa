"""The connector's data path without vLLM: KV caches laid out as vLLM 0.32 lays them out,
saved and loaded through a real daemon by the worker side the connector runs.

Shared by the CPU test (test_datapath) and the GPU test (tests/gpu/test_vllm_datapath),
which differ only in where the backing allocation lives: a shared-memory region, or one
CUDA tensor the daemon opens by IPC. The shapes follow vLLM's KVCacheConfig for a hybrid
model in --mamba-cache-mode align: one backing allocation; an attention group and two
Mamba groups that alias it from byte 0; Mamba pages padded to the attention page size;
layer-outer (LBNHC: every layer a region of pages) or block-outer (BLHNC: a block is the
pages of all layers of the group that owns it). Page contents are random bytes, so a row
copied from or into the wrong place shows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from tiercache.client import Client
from tiercache.hashing import page_chain
from tiercache.integrations.vllm.jobs import LoadJob, SaveJob, head
from tiercache.integrations.vllm.pages import (ATTENTION, MAMBA, CacheGroup, CacheShape,
                                                Placement, member_plans, member_tensors)
from tiercache.integrations.vllm.worker_side import BlockMover, Registrar


def hybrid_shape(num_blocks: int, block_size: int = 16, layers: int = 2, heads: int = 2,
                 head_size: int = 64, block_outer: bool = False) -> CacheShape:
    """What vLLM's get_kv_cache_config_from_groups makes of a hybrid model: fp16 K and V
    pages of `block_size` tokens, Mamba states padded to the same page size."""
    page = 2 * block_size * heads * head_size * 2
    names = [tuple(f"{kind}.{g}.{i}" for i in range(layers))
             for g, kind in enumerate(("attn", "gdn", "gdn"))]
    groups = tuple(CacheGroup(g, ATTENTION if g == 0 else MAMBA, names[g], block_size)
                   for g in range(3))
    if block_outer:
        placements = tuple(Placement(n, page, page * layers) for n in names)
    else:
        placements = tuple(Placement(n, page * num_blocks, page) for n in names)
    return CacheShape(num_blocks, page * num_blocks * layers, groups, placements)


@dataclass
class Drill:
    shape: CacheShape
    backing: torch.Tensor  # flat uint8: the one allocation every group views
    mover: BlockMover
    tokens: list[int]

    @classmethod
    def start(cls, client: Client, shape: CacheShape, device: str, group_id: str) -> "Drill":
        if device == "cpu":
            backing = client.shared_region(shape.nbytes)
        else:
            backing = torch.zeros(shape.nbytes, dtype=torch.uint8, device=device)
        registrar = Registrar(lambda: client, "test/hybrid@1", group_id, 0, 1, ("drill",))
        mover = BlockMover(registrar, shape, backing, retry_after=1.0)
        assert mover.members() is not None
        count = shape.num_blocks * shape.block_size  # enough for a prompt of every block
        tokens = np.random.default_rng(0).integers(1, 50_000, count).tolist()
        return cls(shape, backing, mover, tokens)

    def views(self, group: int) -> dict[str, torch.Tensor]:
        plan = member_plans(self.shape, 0, 1)[group]
        return member_tensors(self.backing, plan, self.shape.num_blocks)

    def fill(self, group: int, blocks: list[int], seed: int) -> None:
        for name, rows in self.views(group).items():
            gen = torch.Generator().manual_seed(seed + hash(name) % 1000)
            data = torch.randint(0, 256, (len(blocks), rows.shape[1]), dtype=torch.uint8,
                                 generator=gen)
            rows[torch.tensor(blocks, device=rows.device)] = data.to(rows.device)

    def rows(self, group: int, blocks: list[int]) -> list[torch.Tensor]:
        index = torch.tensor(blocks, device=self.backing.device)
        return [rows[index].cpu() for rows in self.views(group).values()]

    def chain(self, pages: int):
        root = self.mover.members()[0].root  # every member hashes from the group's root
        return page_chain(self.tokens[:pages * self.shape.block_size], root,
                          self.shape.block_size)

    def save(self, job: int, pages: int, kv: list[int], states: dict[int, int]) -> float:
        """Store pages 1..pages from `kv` and each Mamba group's state after them from its
        block; seconds until every copy is done."""
        ready = None
        if self.backing.is_cuda:
            ready = torch.cuda.Event(interprocess=True)
            ready.record()
        began = time.perf_counter()
        self.mover.save([SaveJob(job, f"req{job}", self.chain(pages), {0: tuple(kv)},
                                 {g: ((pages, b),) for g, b in states.items()})], ready)
        self.mover.drain()
        seconds = time.perf_counter() - began
        assert self.mover.saved() == {job: True}
        return seconds

    def load(self, req: str, pages: int, start: int, kv: list[int], states: dict[int, int]
             ) -> tuple[float, set[str]]:
        """Load pages start+1..pages into `kv` and the states after them; (seconds until
        the bytes are in place, failed requests)."""
        began = time.perf_counter()
        self.mover.start([LoadJob(req, head(self.chain(pages), pages), start, {0: tuple(kv)},
                                  states)])
        while True:
            done, failed = self.mover.finished()
            if req in done:
                break
        if self.backing.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - began, failed

    def close(self) -> None:
        self.mover.close()


def bulk_copy_seconds(nbytes: int, device: str, repeat: int = 3) -> float:
    """The best time of one contiguous copy of `nbytes` on `device`: the physical peer."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        if src.is_cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    return best
