"""The connector's settings, from `kv_connector_extra_config` in --kv-transfer-config.

    --kv-transfer-config '{"kv_connector": "TiercacheConnector",
      "kv_connector_module_path": "tiercache.integrations.vllm.connector",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {"address": "unix:/run/tiercache/tiercache.sock",
                                    "model_id": "Qwen/Qwen3-Next-80B-A3B-Instruct@main"}}'
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from tiercache.client import DEFAULT_ADDRESS, Client, Tls
from tiercache.errors import InvalidArgument


@dataclass(frozen=True)
class ConnectorConfig:
    model_id: str  # names the weights: bytes of two checkpoints must never mix
    address: str = ""  # "" -> $TIERCACHE_ADDRESS, else the default socket
    token: str = ""  # "" -> $TIERCACHE_TOKEN
    tls_ca: str = ""  # TCP with TLS: the CA file; with tls_cert and tls_key, mTLS
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    match_timeout: float = 0.05  # seconds a lookup may take before vLLM goes on without it
    retry_after: float = 2.0  # seconds without lookups after the daemon failed one
    timeout: float = 30.0  # seconds for registering, loading and saving
    group_id: str = ""  # "" -> vLLM's engine id and data-parallel rank

    def __post_init__(self) -> None:
        if not self.model_id:
            raise InvalidArgument("kv_connector_extra_config.model_id is empty: name the model "
                                  "and revision, e.g. \"org/name@rev\"")
        for name in ("match_timeout", "retry_after", "timeout"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise InvalidArgument(f"kv_connector_extra_config.{name} must be a positive "
                                      f"number of seconds, got {getattr(self, name)!r}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], default_model_id: str) -> "ConnectorConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidArgument(f"kv_connector_extra_config has unknown keys {unknown}: use "
                                  f"some of {sorted(known)}")
        return cls(**{"model_id": default_model_id, **extra})

    def client(self, timeout: float | None = None) -> Client:
        tls = None
        if self.tls_ca:
            tls = Tls(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)
        address = self.address or os.environ.get("TIERCACHE_ADDRESS", DEFAULT_ADDRESS)
        return Client(address, timeout=timeout or self.timeout, token=self.token or None, tls=tls)
