"""KV events, in vLLM's own format, for what tiercache holds of a request.

`take_events` hands these to vLLM's event publisher, which sends them to routers beside
vLLM's own. A save that every rank reported complete announces its new attention blocks
(`BlockStored`, medium CPU: the daemon's memory) and each Mamba state as a block of its
cache group (`group_idx`, `kv_cache_spec_kind` "mamba"), with vLLM's block hashes,
token ids and parent hash, so a router can match them as it matches vLLM's own. The
daemon does not tell the connector what it evicts: a block is announced removed when a
lookup finds it missing (`BlockRemoved`), so routers learn of evictions late.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

from tiercache.results import Match, StopReason
from tiercache.integrations.vllm.jobs import SaveJob
from tiercache.integrations.vllm.pages import ATTENTION, MAMBA, CacheShape

_KINDS = {ATTENTION: "full_attention", MAMBA: "mamba"}
_REMEMBERED = 1 << 16  # announced attention blocks kept to announce their removal


class Announcer:
    def __init__(self, shape: CacheShape, hash_block_size: int) -> None:
        self.shape = shape
        self.hash_block_size = hash_block_size
        self._events: list[KVCacheEvent] = []
        self._announced: OrderedDict[tuple[int, Any], None] = OrderedDict()

    def saved(self, request: Any, job: SaveJob, first: int) -> None:
        """A save every rank completed: its new attention blocks and its states."""
        for index, blocks in job.kv_blocks.items():
            if len(blocks) > first:
                self._stored(request, index, first, len(blocks))
        for index, states in job.states.items():
            for pages, _ in states:
                self._stored(request, index, pages - 1, pages)

    def missed(self, request: Any, match: Match, asked: int) -> None:
        """A lookup found pages missing that were announced: announce them removed."""
        if match.stop != StopReason.MISSING_PAGE:
            return  # KV still there; only a state is (a checkpoint tells nothing of KV)
        hashes = self._hashes(request)[match.pages:asked]
        for group in self.shape.groups:
            gone = [h for h in hashes if (group.index, h) in self._announced]
            for h in gone:
                del self._announced[(group.index, h)]
            if gone:
                self._events.append(BlockRemoved(block_hashes=gone, medium=MEDIUM_CPU,
                                                 group_idx=group.index))

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def _stored(self, request: Any, index: int, first: int, end: int) -> None:
        hashes = self._hashes(request)
        if end > len(hashes):
            return  # vLLM has not hashed these tokens (yet): nothing a router could match
        bs = self.shape.block_size
        kind = next(g.kind for g in self.shape.groups if g.index == index)
        lora = request.lora_request
        self._events.append(BlockStored(
            block_hashes=hashes[first:end], parent_block_hash=hashes[first - 1] if first else None,
            token_ids=list(request.all_token_ids[first * bs:end * bs]), block_size=bs,
            lora_id=lora.adapter_id if lora else None, medium=MEDIUM_CPU,
            lora_name=lora.name if lora else None, group_idx=index,
            kv_cache_spec_kind=_KINDS[kind]))
        if kind == ATTENTION:
            for h in hashes[first:end]:
                self._announced[(index, h)] = None
            while len(self._announced) > _REMEMBERED:
                self._announced.popitem(last=False)

    def _hashes(self, request: Any) -> list[Any]:
        resolved = resolve_block_hashes(request.block_hashes, self.hash_block_size,
                                        self.shape.block_size)
        return [maybe_convert_block_hash(resolved[i]) for i in range(len(resolved))]
