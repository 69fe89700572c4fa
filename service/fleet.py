"""What a store shares beyond this node: whether its entries go to the shared remote
tier, and what routers are told about it (KV events). The servicer asks before each
store; the answers come from the daemon's settings (README: Past one node)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiercache_service.workers import Registration
from tiercache.errors import InvalidArgument
from tiercache.events import EventLog

ALL_TENANTS = "*"


@dataclass(frozen=True)
class Fleet:
    events: EventLog | None = None  # None: KV events are off
    event_tenant: str = ""  # whose stores are published; "*": every tenant's (fleet-wide)
    local_tenants: frozenset[str] = frozenset()  # their entries never leave this node
    local_models: frozenset[str] = frozenset()

    def before_store(self, worker: Registration, keys: np.ndarray, tokens: bytes) -> bool:
        """Announce a store to the KV event stream if its tenant is published (with its
        tokens, if the worker sent them); returns whether its entries may go to the
        remote tier. `keys` are the engine's (masked) keys of the prompt."""
        tenant, model = worker.identity.tenant, worker.namespace.model_id
        if self.events is not None and self.event_tenant in (ALL_TENANTS, tenant):
            page = worker.layout.page_tokens
            if len(tokens) % 4 or len(tokens) // 4 > len(keys) * page:
                raise InvalidArgument(f"event_tokens must be uint32 tokens, at most {page} per "
                                      f"key: got {len(tokens)} bytes for {len(keys)} keys")
            ids = np.frombuffer(tokens, "<u4") if tokens else None
            self.events.announce(model, keys, page, ids)
        return tenant not in self.local_tenants and model not in self.local_models


def names(value: str) -> frozenset[str]:
    """"a, b" -> {"a", "b"}."""
    return frozenset(n.strip() for n in value.split(",") if n.strip())
