"""tiercache as a vLLM KV connector for hybrid attention + Mamba/GDN models.

    vllm serve MODEL --enable-prefix-caching --mamba-cache-mode align \\
      --kv-transfer-config '{"kv_connector": "TiercacheConnector",
        "kv_connector_module_path": "tiercache.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"address": "unix:/run/tiercache/tiercache.sock",
                                      "model_id": "org/name@rev"}}'

This module is glue: vLLM calls it in the scheduler process (role SCHEDULER, see
scheduler_side) and in every worker (role WORKER, see worker_side); the shapes of its KV
cache come from its KVCacheConfig (pages). Built against vLLM 0.32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults,
    KVConnectorWorkerMetadata, SupportsHMA)
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, MambaSpec,
                                        UniformTypeKVCacheSpecs)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiercache.errors import InvalidArgument
from tiercache.results import Tier
from tiercache.integrations.vllm.config import ConnectorConfig
from tiercache.integrations.vllm.events import Announcer
from tiercache.integrations.vllm.jobs import Jobs, SaveReport
from tiercache.integrations.vllm.pages import (ATTENTION, MAMBA, CacheGroup, CacheShape,
                                                Placement, backing_of)
from tiercache.integrations.vllm.scheduler_side import SchedulerSide
from tiercache.integrations.vllm.worker_side import BlockMover, Registrar

_SOURCES = {Tier.DEVICE: CacheHitSource.DEVICE, Tier.HOST: CacheHitSource.HOST,
            Tier.DISK: CacheHitSource.DISK}


@dataclass
class TiercacheMetadata(KVConnectorMetadata):
    jobs: Jobs


@dataclass
class SaveReportMetadata(KVConnectorWorkerMetadata):
    report: SaveReport

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, SaveReportMetadata)
        return SaveReportMetadata(self.report.merged(other.report))


def cache_shape(config: KVCacheConfig) -> CacheShape:
    """vLLM's KVCacheConfig as pages.CacheShape; unsupported layouts say what to change."""
    groups = []
    for index in config.transfer_group_ids:
        group = config.kv_cache_groups[index]
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align":
            kind = MAMBA
        elif type(spec) is FullAttentionSpec and spec.sliding_window is None \
                and spec.attention_chunk_size is None:
            kind = ATTENTION
        else:
            raise InvalidArgument(f"KV cache group {index} is {type(spec).__name__}"
                                  f"{'' if not isinstance(spec, MambaSpec) else ' without align'}: "
                                  "tiercache's connector takes full attention and Mamba groups "
                                  "in --mamba-cache-mode align")
        groups.append(CacheGroup(index, kind, tuple(group.layer_names), spec.block_size))
    if not config.kv_cache_tensors:
        raise InvalidArgument("vLLM's KVCacheConfig places no KV cache tensors")
    placements = tuple(Placement(tuple(t.layers), t.layer_stride, t.block_stride, t.offset)
                       for t in config.kv_cache_tensors)
    return CacheShape(config.num_blocks, config.kv_cache_tensors[0].size, tuple(groups),
                      placements)


class TiercacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        if not vllm_config.cache_config.enable_prefix_caching:
            raise InvalidArgument("tiercache's connector needs --enable-prefix-caching (vLLM "
                                  "hashes blocks and offers Mamba states only with it)")
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            raise InvalidArgument("set \"kv_load_failure_policy\": \"recompute\" in "
                                  "--kv-transfer-config: with \"fail\", a cache entry evicted "
                                  "between lookup and load fails the request")
        if parallel.pipeline_parallel_size > 1:
            raise InvalidArgument("tiercache's connector does not support pipeline parallelism "
                                  "yet: use tensor parallelism")
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = ConnectorConfig.from_extra(extra, f"{model.model}@{model.revision or ''}")
        self.shape = cache_shape(kv_cache_config)
        self.group_id = self.config.group_id or (
            f"{self._kv_transfer_config.engine_id}/dp{parallel.data_parallel_rank}")
        # what else decides whether bytes are reusable: vLLM's version, page layout, specs
        self.extra = (f"vllm {vllm.__version__}", f"layout {kv_cache_config.kv_cache_layout}",
                      *(f"group {i}: {g.kv_cache_spec!r}"
                        for i, g in enumerate(kv_cache_config.kv_cache_groups)))
        self.mover: BlockMover | None = None
        self._side: SchedulerSide | None = None
        self._events: Announcer | None = None
        if role == KVConnectorRole.SCHEDULER:
            hash_block = kv_cache_config.hash_block_size or self.shape.block_size
            self._events = Announcer(self.shape, hash_block)
            self._side = SchedulerSide(self.config, self.shape, self.group_id,
                                       parallel.tensor_parallel_size, self._events)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later miss, never a wrong answer

    # -- worker -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        rank, size = _tp_rank_and_size(self._vllm_config)
        registrar = Registrar(self.config.client, self.config.model_id, self.group_id, rank, size,
                              self.extra)
        self.mover = BlockMover(registrar, self.shape, backing_of(self.shape, kv_caches),
                                self.config.retry_after)
        self.mover.members()  # register now; a daemon that is down is tried again later

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.mover is not None and self.has_connector_metadata():
            self.mover.start(self._jobs().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before vLLM schedules the request (asynchronous loads)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole blocks are saved after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        if self.mover is None or not self.has_connector_metadata():
            return
        self.mover.members()  # once a step: registers again after the daemon came back
        saves = self._jobs().saves
        if saves:
            ready = None
            if self.mover.on_gpu:  # the daemon's copies wait for this step's forward pass
                ready = torch.cuda.Event(interprocess=True)
                ready.record()
            self.mover.save(saves, ready)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.mover is None:
            return KVConnectorTransferResults()
        done, failed = self.mover.finished()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        saved = self.mover.saved() if self.mover is not None else {}
        if not saved:
            return None
        return SaveReportMetadata(SaveReport({job: (1, ok) for job, ok in saved.items()}))

    def shutdown(self) -> None:
        if self.mover is not None:
            self.mover.close()
            self.mover = None

    def _jobs(self) -> Jobs:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TiercacheMetadata)
        return metadata.jobs

    # -- scheduler ----------------------------------------------------------------------
    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        assert self._side is not None
        self._side.pool = gpu_block_pool

    def on_new_request(self, request: Any) -> None:
        assert self._side is not None
        self._side.track(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self._side is not None
        return self._side.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._side is not None
        self._side.plan_load(request, blocks.get_block_ids(), num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        assert self._side is not None
        tracked = self._side.requests.get(request.request_id)
        hit = tracked.hit if tracked is not None else None
        if not num_external_tokens or hit is None:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens} \
                if num_external_tokens else {}
        bs, match, sources = self.shape.block_size, hit.match, {}
        state = int(match.checkpoint_tier or 0)
        first = hit.local // bs
        for page in range(first, first + num_external_tokens // bs):
            code = max(match.tier_codes[page] if match.tier_codes else 0, state)
            source = _SOURCES.get(Tier(code), CacheHitSource.EXTERNAL_UNSPECIFIED) \
                if code else CacheHitSource.EXTERNAL_UNSPECIFIED
            sources[source] = sources.get(source, 0) + bs
        return sources

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._side is not None
        return TiercacheMetadata(self._side.build(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._side is not None
        meta = connector_output.kv_connector_worker_meta
        report = meta.report if isinstance(meta, SaveReportMetadata) else None
        self._side.reported(report, set(connector_output.finished_recving or ()))

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self._side is not None
        return self._side.finished(request), None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._side is not None
        return self._side.finished(request), None

    def has_pending_push_work(self) -> bool:
        # save completions reach the scheduler only with a step: keep stepping until the
        # blocks they hold are released
        return self._side is not None and bool(self._side.pins)

    def take_events(self) -> Iterable[Any]:
        return self._events.take() if self._events is not None else ()


def _tp_rank_and_size(vllm_config: Any) -> tuple[int, int]:
    from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                 get_tensor_model_parallel_world_size,
                                                 model_parallel_is_initialized)
    if model_parallel_is_initialized():
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    size = vllm_config.parallel_config.tensor_parallel_size
    if size != 1:
        raise InvalidArgument(f"a worker of a {size}-way tensor-parallel engine started "
                              "without vLLM's parallel state: cannot tell its rank")
    return 0, 1
