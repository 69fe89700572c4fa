"""One adapter per URL scheme of a remote store (the contract is store.py)."""

from __future__ import annotations

from tiercache.tiers.remote.store import RemoteConfig, RemoteStore


def open_store(config: RemoteConfig) -> RemoteStore:
    """The adapter for the config's URL scheme."""
    from tiercache.tiers.remote.redis_cluster import RedisClusterStore  # redis only if asked
    return RedisClusterStore.open(config)
