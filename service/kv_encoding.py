"""vLLM's KV event wire format, as routers (llm-d's KV-cache indexer, NVIDIA Dynamo)
decode it: vllm/distributed/kv_events.py (v0.28 and later), msgspec structs encoded
with msgpack.

- A batch is positional: `[ts, events, data_parallel_rank]` (EventBatch, array_like).
- An event is a map tagged by `"type"` (KVCacheEvent, tag=True), its fields in their
  declared order; fields with a default are left out while they hold it (omit_defaults):
  `BlockStored` {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, group_idx, kv_cache_spec_kind}, `BlockRemoved` {block_hashes, medium,
  group_idx}, `AllBlocksCleared` {}.
- A block hash is bytes or an int (ExternalBlockHash); ours are the 16-byte engine keys.

KV pages are group 0, of kind `full_attention`; checkpoints group 1, of kind `mamba`.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from tiercache.events import Blocks, Change
from tiercache.results import Kind

GROUPS = {Kind.PAGE: (0, "full_attention"), Kind.CHECKPOINT: (1, "mamba")}


def event(blocks: Blocks) -> dict[str, Any]:
    group, spec = GROUPS[blocks.kind]
    if blocks.change is Change.REMOVED:
        return {"type": "BlockRemoved", "block_hashes": list(blocks.keys),
                "medium": blocks.medium, "group_idx": group}
    return {"type": "BlockStored", "block_hashes": list(blocks.keys),
            "parent_block_hash": blocks.parent, "token_ids": list(blocks.tokens),
            "block_size": blocks.page_tokens, "lora_id": None, "medium": blocks.medium,
            "lora_name": None, "group_idx": group, "kv_cache_spec_kind": spec}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def batch(events: list[dict[str, Any]], data_parallel_rank: int = 0,
          ts: float | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, events, data_parallel_rank],
                         use_bin_type=True)
