"""vLLM's real scheduler on the CPU, the connector in both roles, and a stand-in model.

Imported only by tests that skip without vLLM. Everything here is vLLM's own code
except the model: the Scheduler, the KVCacheConfig its own function lays out, the
per-layer views its own `create_kv_cache_views` makes (over a shared-memory region, so
the daemon can map them), its KVOutputAggregator, and the connector as vLLM loads it
(by module path, from kv_transfer_config).

The stand-in model does what vLLM's model runner does to the cache in
`--mamba-cache-mode align`, with bytes that are a function of the tokens: for each
request scheduled, it first reads what the forward pass would read (every attention
block before the computed tokens, and the Mamba state after them in block
(computed - 1) // block_size) and records a mismatch if any byte differs from what a
model that computed the prefix itself would hold; then it writes the KV of the blocks it
computed and the state after its last token into block cdiv(end, block_size) - 1.
A wrong state or page anywhere shows up as a mismatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import xxhash
from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         ParallelConfig, SchedulerConfig, VllmConfig)
from vllm.config.cache import _layout_from_name
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (get_kv_cache_config_from_groups,
                                         get_request_block_hasher, init_none_hash)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        MambaSpec, create_kv_cache_views)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tiercache.client import Client
from tiercache.integrations.vllm.connector import TiercacheConnector

BLOCK = 16
ATTENTION = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16)
MAMBA = MambaSpec(block_size=BLOCK, shapes=((3, 16), (2, 8, 8)),
                  dtypes=(torch.float16, torch.float32), mamba_cache_mode="align",
                  page_size_padded=ATTENTION.page_size_bytes)
GROUPS = (("attn.0", "attn.3"), ("gdn.1", "gdn.4"), ("gdn.2", "gdn.5"))  # attention, 2x Mamba
MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_hidden_layers": 6, "vocab_size": 1000, "max_position_embeddings": 4096,
                "torch_dtype": "float16"}


def vllm_config(model_dir: Path, address: str, tp: int = 1, layout: str = "LBNHC",
                batch_tokens: int = 32, **extra) -> VllmConfig:
    """A VllmConfig for the CPU: a local directory with only a config.json (no weights,
    no tokenizer), prefix caching and chunked prefill on, Mamba in align mode."""
    (model_dir / "config.json").write_text(json.dumps(MODEL_CONFIG))
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, mamba_cache_mode="align")
    cache.kv_cache_layout = layout  # the engine core resolves this; workers adopt it
    transfer = KVTransferConfig(
        kv_connector="TiercacheConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_module_path="tiercache.integrations.vllm.connector",
        kv_connector_extra_config={"address": address, "model_id": "test/hybrid@1", **extra})
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16",
                                 seed=0, max_model_len=2048),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=batch_tokens,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=cache, kv_transfer_config=transfer, device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp))


def kv_cache_config(config: VllmConfig, num_blocks: int) -> KVCacheConfig:
    groups = [KVCacheGroupSpec(list(GROUPS[0]), ATTENTION),
              *(KVCacheGroupSpec(list(names), MAMBA) for names in GROUPS[1:])]
    per_block = ATTENTION.page_size_bytes * len(GROUPS[0])
    made = get_kv_cache_config_from_groups(config, groups, per_block * num_blocks)
    made.kv_cache_layout = config.cache_config.kv_cache_layout
    made.hash_block_size = BLOCK
    return made


def _content(salt: str, tokens, nbytes: int) -> torch.Tensor:
    """The bytes a model would hold for `salt` after `tokens`: a function of both."""
    seed = xxhash.xxh64_intdigest(salt.encode() + bytes(str(list(tokens)), "ascii"))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


@dataclass
class Rank:
    """One TP worker: its KV cache in a shared region, vLLM's views of it, the connector."""

    rank: int
    views: dict[str, torch.Tensor]
    connector: TiercacheConnector

    def read(self, layer: str, block: int) -> torch.Tensor:
        """A page through vLLM's view of it, as bytes in the view's logical order."""
        return self.views[layer][block].contiguous().view(torch.uint8).reshape(-1)

    def write(self, layer: str, block: int, content: torch.Tensor) -> None:
        page = self.views[layer][block]  # strided in some layouts: copy_ follows the strides
        page.copy_(content.view(page.dtype).view(page.shape))

    def size(self, layer: str) -> int:
        page = self.views[layer][0]
        return page.numel() * page.element_size()


@dataclass
class Engine:
    scheduler: Scheduler
    ranks: list[Rank]
    mismatches: list[str] = field(default_factory=list)
    steps: int = 0
    starts: dict[str, list[int]] = field(default_factory=dict)  # tokens before each forward
    finished: dict[str, str] = field(default_factory=dict)  # request -> how it finished

    def add(self, request_id: str, tokens: list[int], max_tokens: int = 2) -> Request:
        request = Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens,
                                                                  ignore_eos=True), None,
                          block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.scheduler.add_request(request)
        return request

    def step(self, drain_saves: bool = True):
        """One engine step: schedule, run the workers' connectors around the stand-in
        forward pass as vLLM's model runner does, aggregate, update the scheduler."""
        output = self.scheduler.schedule()
        for rank in self.ranks:
            rank.connector.bind_connector_metadata(output.kv_connector_metadata)
            if output.has_sync_kv_loads:
                rank.connector.start_load_kv(None)
        self._forward(output)
        outputs = []
        for rank in self.ranks:
            if not output.has_sync_kv_loads:
                rank.connector.start_load_kv(None)
            rank.connector.wait_for_save()
            if drain_saves:
                rank.connector.mover.drain()
            outputs.append(self._runner_output(output, rank.connector))
            rank.connector.clear_connector_metadata()
        merged = KVOutputAggregator(len(self.ranks)).aggregate(outputs)
        for outputs_of_client in self.scheduler.update_from_output(output, merged).values():
            for out in outputs_of_client.outputs:
                if out.finish_reason is not None:
                    self.finished[out.request_id] = str(out.finish_reason)
        self.steps += 1
        return output

    def run(self, limit: int = 200) -> None:
        while self.scheduler.has_requests() or self.scheduler.connector.has_pending_push_work():
            self.step()
            assert self.steps < limit, "the engine did not finish"

    def _forward(self, output) -> None:
        for req_id, scheduled in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            end = request.num_computed_tokens  # the scheduler counts this step in already
            start = end - scheduled
            self.starts.setdefault(req_id, []).append(start)
            for rank in self.ranks:
                self._check(rank, request, blocks, start)
                self._write(rank, request, blocks, start, end)

    def _check(self, rank: Rank, request: Request, blocks, start: int) -> None:
        tokens = request.all_token_ids
        for block_index in range(start // BLOCK):
            for layer in GROUPS[0]:
                want = _content(f"{rank.rank}/{layer}", tokens[:(block_index + 1) * BLOCK],
                                rank.size(layer))
                if not torch.equal(rank.read(layer, blocks[0][block_index]), want):
                    self.mismatches.append(f"{request.request_id}: KV page {block_index} of {layer}")
        if start:
            for group, names in enumerate(GROUPS[1:], start=1):
                for layer in names:
                    want = _content(f"{rank.rank}/{layer}", tokens[:start], rank.size(layer))
                    if not torch.equal(rank.read(layer, blocks[group][(start - 1) // BLOCK]), want):
                        self.mismatches.append(f"{request.request_id}: state after {start} in {layer}")

    def _write(self, rank: Rank, request: Request, blocks, start: int, end: int) -> None:
        tokens = request.all_token_ids
        for block_index in range(start // BLOCK, -(-end // BLOCK)):
            upto = min((block_index + 1) * BLOCK, end)
            for layer in GROUPS[0]:  # a partial block is rewritten when it fills
                rank.write(layer, blocks[0][block_index],
                           _content(f"{rank.rank}/{layer}", tokens[:upto], rank.size(layer)))
        for group, names in enumerate(GROUPS[1:], start=1):
            for layer in names:
                rank.write(layer, blocks[group][-(-end // BLOCK) - 1],
                           _content(f"{rank.rank}/{layer}", tokens[:end], rank.size(layer)))

    def _runner_output(self, output, connector: TiercacheConnector) -> ModelRunnerOutput:
        from vllm.v1.outputs import KVConnectorOutput
        results = connector.get_transfer_results(output.finished_req_ids)
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens
            sampled.append([7 + len(request.all_token_ids) % 50] if done >= request.num_tokens
                           else [])
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                kv_connector_worker_meta=connector.build_connector_worker_meta()))

    def close(self) -> None:
        for rank in self.ranks:
            rank.connector.shutdown()


def engine(config: VllmConfig, num_blocks: int, client: Client, ranks: int = 1,
           monkeypatch=None) -> Engine:
    """The scheduler (which makes its own SCHEDULER connector) and one WORKER connector
    per TP rank, each registering vLLM's views of its own shared region."""
    init_none_hash(sha256)
    made = kv_cache_config(config, num_blocks)
    config.cache_config.num_gpu_blocks = made.num_blocks
    workers = []
    for rank in range(ranks):
        if monkeypatch is not None:  # which rank am I: vLLM's parallel state, not set up here
            monkeypatch.setattr("tiercache.integrations.vllm.connector._tp_rank_and_size",
                                lambda _config, r=rank: (r, ranks))
        workers.append(_rank(config, made, client, rank))
    scheduler = Scheduler(vllm_config=config, kv_cache_config=made,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=BLOCK, hash_block_size=BLOCK, log_stats=True)
    return Engine(scheduler, workers)


def _rank(config: VllmConfig, made: KVCacheConfig, client: Client, rank: int) -> Rank:
    size = made.kv_cache_tensors[0].size
    raw = client.shared_region(size).view(torch.int8)
    layout = _layout_from_name(config.cache_config.kv_cache_layout)
    views = {}
    for tensor in made.kv_cache_tensors:
        spec = ATTENTION if tensor.layers[0] in GROUPS[0] else MAMBA
        views.update(zip(tensor.layers, create_kv_cache_views(raw, spec, made.num_blocks, layout,
                                                              tensor)))
    connector = TiercacheConnector(config, KVConnectorRole.WORKER, made)
    connector.register_kv_caches(views)
    return Rank(rank, views, connector)


def prompt(seed: int, length: int, prefix: list[int] | None = None) -> list[int]:
    import numpy as np
    tail = np.random.default_rng(seed).integers(1, 900, length - len(prefix or [])).tolist()
    return list(prefix or []) + tail


def iterate(engine: Engine, requests: dict[str, list[int]]) -> Iterator[None]:
    for req_id, tokens in requests.items():
        engine.add(req_id, tokens)
        yield
