"""The daemon's one frozen configuration: defaults, then an optional TOML file, then
TIERCACHE_* environment variables, then command-line flags, each overriding the last."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass, fields
from typing import Any, Mapping

from service import tls
from service.kv_events import KvEventsConfig
from tiercache.engine import EngineConfig
from tiercache.hashing import HASHES
from tiercache.errors import InvalidArgument
from tiercache.policy import AdmissionConfig, PolicyConfig, WriteConfig
from tiercache.remote import RemoteTierConfig
from tiercache.tiers.device import DeviceConfig
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig
from tiercache.tiers.remote.store import RemoteConfig

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


def parse_bytes(value: Any) -> int:
    """1048576, "1MiB", "1.5 GB" -> bytes."""
    if isinstance(value, int):
        return value
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not found or found.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"{value!r} is not a size: write e.g. 4GiB, 512MiB or 1048576")
    return int(float(found.group(1)) * _UNITS[found.group(2).lower()])


@dataclass(frozen=True)
class ServiceConfig:
    data_dir: str = "./tiercache-data"  # LMDB files and, by default, the socket
    socket: str = ""  # Unix socket path; "" = <data_dir>/tiercache.sock
    tcp: str = ""  # host:port to listen on as well (opt-in, plaintext unless TLS is set)
    host_budget: int = 1 << 30  # bytes of host memory for cached entries
    device_budget: int = 2 << 30  # bytes of GPU memory for cached entries (0: no device tier)
    disk_map_size: int = 16 << 30  # LMDB map size: fixed for the life of the environment
    disk: bool = True  # keep a disk tier under <data_dir>/lmdb
    disk_sync: bool = True  # fsync every LMDB commit
    policy: str = "lru"  # eviction: lru, or flop (FLOP-aware)
    policy_alpha: float = 2.0  # flop: weight of FLOPs saved per byte against recency
    policy_tune_alpha: bool = False  # flop: adjust alpha by what evictions turned out to cost
    policy_writes: str = "back"  # host -> disk: ahead of eviction (back), or after each store (through)
    policy_admission: str = "policy"  # checkpoints kept: the end and branch points (policy), or all
    policy_checkpoint_interval: int = 0  # under "policy", also every this many pages
    max_message_bytes: int = 16 << 20
    max_concurrent_rpcs: int = 64  # cache calls in flight (health checks have their own room)
    max_calls_per_tenant: int = 32  # of those, one tenant's
    request_seconds: float = 10.0  # a call that has not sent its request by then is cancelled
    max_workers: int = 32  # registered workers at a time
    max_prompt_pages: int = 1 << 16  # keys in one request
    min_entry_bytes: int = 64  # smaller KV pages or checkpoints are refused at registration
    grace_seconds: float = 10.0  # for in-flight calls at shutdown
    flush_on_exit: bool = True  # write host entries to disk when stopping
    # who may call, and how (service/auth.py, service/tls.py, tiercache/tenancy.py)
    tenants_file: str = ""  # TOML: tenants, their tokens and certificate names ("": one tenant)
    socket_tenant: str = ""  # the tenant of Unix-socket callers that bring no token
    require_identity: bool = False  # Unix-socket callers need a token too
    hash: str = ""  # the page hash every worker must use ("": theirs); blake2b_128 resists attacks
    max_workers_per_tenant: int = 0  # 0: only max_workers limits a tenant
    tls_cert: str = ""  # PEM certificate for the TCP port
    tls_key: str = ""
    tls_client_ca: str = ""  # PEM CA: TCP clients must present a certificate it signed (mTLS)
    tcp_insecure: bool = False  # allow plaintext TCP on an address other machines can reach
    # operations: metrics, probes, logs (README: Operations)
    metrics_address: str = "127.0.0.1:9477"  # Prometheus /metrics; "" = off, port 0 = any free
    health_address: str = ""  # host:port serving gRPC health only, for Kubernetes probes
    drain_seconds: float = 0.0  # NOT_SERVING but still answering, this long after SIGTERM
    log_format: str = "text"  # text or json (one object a line)
    log_level: str = "info"
    secret_file: str = ""  # masks keys per namespace; "" = <data_dir>/secret (share it to share entries)
    # past one node (README: Past one node): a shared remote tier, KV events for routers
    remote: str = ""  # redis-cluster://host:port[,host:port...]; "" = no remote tier
    remote_namespace: str = ""  # "" = derived from the secret: daemons sharing it share entries
    remote_lookup_seconds: float = 0.05  # a Match's budget for the remote tier
    remote_writes: str = "through"  # through (behind each store) or evict (as entries leave the node)
    remote_local_tenants: str = ""  # comma-separated: their entries never leave this node
    remote_local_models: str = ""
    kv_events: str = ""  # ZMQ PUB endpoint, e.g. tcp://*:5557; "" = no KV events
    kv_events_replay: str = ""  # ZMQ ROUTER endpoint for replays, e.g. tcp://*:5558
    kv_events_pod: str = ""  # the topic's pod part (kv@<pod>@<model>); "" = <hostname>:<port>
    kv_events_tenant: str = ""  # whose stores are published; "*" = every tenant's

    @property
    def socket_path(self) -> str:
        return self.socket or os.path.join(self.data_dir, "tiercache.sock")

    @property
    def secret_path(self) -> str:
        return self.secret_file or os.path.join(self.data_dir, "secret")

    def engine(self, remote_namespace: str = "unchecked") -> EngineConfig:
        """The engine's config; `remote_namespace` is used where `remote_namespace` is not
        set (the daemon derives it from its secret)."""
        disk = DiskConfig(os.path.join(self.data_dir, "lmdb"), self.disk_map_size,
                          sync=self.disk_sync) if self.disk else None
        device = DeviceConfig(budget_bytes=self.device_budget) if self.device_budget else None
        policy = PolicyConfig(self.policy, self.policy_alpha, self.policy_tune_alpha,
                              AdmissionConfig(self.policy_admission, self.policy_checkpoint_interval),
                              WriteConfig(host=self.policy_writes))
        remote = RemoteTierConfig(RemoteConfig(
            self.remote, namespace=self.remote_namespace or remote_namespace,
            lookup_seconds=self.remote_lookup_seconds), writes=self.remote_writes) if self.remote else None
        return EngineConfig(host=HostConfig(budget_bytes=self.host_budget), disk=disk,
                            device=device, policy=policy, remote=remote)

    def kv_events_config(self) -> KvEventsConfig | None:
        if not self.kv_events:
            return None
        return KvEventsConfig(self.kv_events, self.kv_events_replay, self.kv_events_pod)

    def check(self) -> "ServiceConfig":
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "float") and not math.isfinite(value):
                raise InvalidArgument(f"{f.name} must be a finite number, got {value}")
            if f.name in _POSITIVE and value <= 0:
                raise InvalidArgument(f"{f.name} must be positive, got {value}")
            if f.type in ("int", "float") and value < 0:
                raise InvalidArgument(f"{f.name} must be 0 or more, got {value}")
            if f.name.endswith("_seconds") and value > _MAX_SECONDS:
                raise InvalidArgument(f"{f.name} = {value} is over a day: give at most {_MAX_SECONDS}")
        self.engine()  # the engine's own checks (the policy's too)
        if self.hash and self.hash not in HASHES:
            raise InvalidArgument(f"hash {self.hash!r} is unknown: use one of {sorted(HASHES)}")
        tls.check(self.tcp, self.tls_cert, self.tls_key, self.tls_client_ca, self.tcp_insecure)
        self._check_operations()
        self.kv_events_config()
        return self

    def _check_operations(self) -> None:
        for name in ("metrics_address", "health_address"):
            if getattr(self, name):
                host_port(getattr(self, name), name)
        if self.log_format not in ("text", "json"):
            raise InvalidArgument(f"log_format={self.log_format!r}: use text or json")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise InvalidArgument(f"log_level={self.log_level!r}: use debug, info, warning or error")


def read_toml(path: str, what: str) -> dict[str, Any]:
    """A TOML file's tables; a file that is missing or not TOML says so in one line."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as error:
        raise InvalidArgument(f"{what} {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise InvalidArgument(f"{what} {path} is not valid TOML ({error}): fix that line") from None


def host_port(address: str, setting: str) -> tuple[str, int]:
    """"127.0.0.1:9477", "[::1]:9477", "0.0.0.0:0" -> (host, port)."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"{setting}={address!r} is not host:port: write e.g. 127.0.0.1:9477")
    return host.removeprefix("[").removesuffix("]"), int(port)


# settings that must be above 0; every other number must be 0 or more, and all finite
_POSITIVE = {"host_budget", "disk_map_size", "max_message_bytes", "max_concurrent_rpcs",
             "max_calls_per_tenant", "max_workers", "max_prompt_pages", "min_entry_bytes",
             "request_seconds"}
_MAX_SECONDS = 86_400
_SIZES = {"host_budget", "device_budget", "disk_map_size", "max_message_bytes"}


def _coerce(name: str, value: Any) -> Any:
    kind = {f.name: f.type for f in fields(ServiceConfig)}[name]
    if name in _SIZES:
        return parse_bytes(value)
    if kind == "bool" and isinstance(value, str):
        if value.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise InvalidArgument(f"{name}={value!r} is not a boolean: use true or false")
        return value.lower() in ("1", "true", "yes", "on")
    try:
        return {"int": int, "float": float, "str": str, "bool": bool}[kind](value)
    except ValueError:
        raise InvalidArgument(f"{name}={value!r} is not a valid {kind}") from None


def _overrides(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    names = {f.name for f in fields(ServiceConfig)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise InvalidArgument(f"{source}: unknown setting(s) {unknown}; known: {sorted(names)}")
    return {k: _coerce(k, v) for k, v in values.items()}


# TIERCACHE_* variables that are not settings: the config file's path, fault injection
# (tiercache.failpoints), the per-step trace (tiercache.trace), and what workers' clients read
_NOT_SETTINGS = {"TIERCACHE_CONFIG", "TIERCACHE_FAILPOINTS", "TIERCACHE_ADDRESS", "TIERCACHE_TOKEN",
                 "TIERCACHE_HANDOVER", "TIERCACHE_TRACE"}


def load(path: str | None = None, environ: Mapping[str, str] = os.environ,
         flags: Mapping[str, Any] | None = None) -> ServiceConfig:
    """Defaults < TOML file < TIERCACHE_* environment < flags."""
    config = ServiceConfig()
    if path:
        config = dataclasses.replace(config, **_overrides(read_toml(path, "--config"), path))
    env = {k[len("TIERCACHE_"):].lower(): v for k, v in environ.items()
           if k.startswith("TIERCACHE_") and k not in _NOT_SETTINGS}
    config = dataclasses.replace(config, **_overrides(env, "environment"))
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    return dataclasses.replace(config, **_overrides(given, "flags")).check()


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One --flag per setting; unset flags leave the file and environment in charge."""
    parser.add_argument("--config", default=os.environ.get("TIERCACHE_CONFIG"),
                        help="TOML file with settings (env TIERCACHE_CONFIG)")
    for f in fields(ServiceConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, dest=f.name, default=None,
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper())
