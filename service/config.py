"""The daemon's one frozen configuration: defaults, then an optional TOML file, then
TIERCACHE_* environment variables, then command-line flags, each overriding the last.

Every setting is declared once, in ServiceConfig, with one line of help, the unit of a
number and the values a word may take (`setting`). The flags and their --help, the file,
the environment, the checks and the README's table all read that declaration
(`SETTINGS`). A value that does not fit is refused in one line that names where it came
from (the file, the variable or the flag), the setting, and what to write instead."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import tomllib
from dataclasses import dataclass
from typing import Any, Mapping

from tiercache_service import tls
from tiercache_service.cpus import parse as parse_cpus
from tiercache_service.kv_events import KvEventsConfig
from tiercache_service.settings import BYTES, SECONDS, Setting, Source, declared, parse_bytes, setting
from tiercache.engine import EngineConfig
from tiercache.hashing import HASHES
from tiercache.errors import InvalidArgument
from tiercache.policy import POLICIES, AdmissionConfig, PolicyConfig, WriteConfig
from tiercache.remote import RemoteTierConfig
from tiercache.tiers.device import DeviceConfig
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig
from tiercache.tiers.remote.store import RemoteConfig

@dataclass(frozen=True)
class ServiceConfig:
    data_dir: str = setting("./tiercache-data", "LMDB files, the secret and, by default, the "
                                                "socket")
    socket: str = setting("", "Unix socket to listen on; \"\": <data_dir>/tiercache.sock")
    tcp: str = setting("", "host:port to listen on as well (opt-in; plaintext unless tls_cert "
                           "is set); \"\": none")
    host_budget: int = setting(1 << 30, "host memory for cached entries", BYTES, positive=True)
    device_budget: int = setting(2 << 30, "GPU memory for cached entries (0: no device tier)",
                                 BYTES)
    disk_map_size: int = setting(16 << 30, "LMDB map size: fixed for the life of the environment",
                                 BYTES, positive=True)
    disk: bool = setting(True, "keep a disk tier under <data_dir>/lmdb")
    disk_sync: bool = setting(True, "fsync every LMDB commit")
    policy: str = setting("lru", "eviction: least recently used, or flop (FLOPs saved per byte "
                                 "against recency)", choices=tuple(POLICIES))
    policy_alpha: float = setting(2.0, "flop: weight of FLOPs saved per byte against recency",
                                  "factor")
    policy_tune_alpha: bool = setting(False, "flop: adjust policy_alpha by what evictions turned "
                                             "out to cost")
    policy_writes: str = setting("back", "host to disk: ahead of eviction (back), or right after "
                                         "each store (through)", choices=("back", "through"))
    policy_admission: str = setting("policy", "checkpoints kept: the end and branch points "
                                              "(policy), or all", choices=("policy", "all"))
    policy_checkpoint_interval: int = setting(0, "under policy_admission=policy, also one every "
                                                 "this many pages (0: none)", "pages")
    max_message_bytes: int = setting(16 << 20, "largest gRPC message", BYTES, positive=True)
    max_concurrent_rpcs: int = setting(64, "cache calls in flight (health checks have their own "
                                           "room)", "calls", positive=True)
    max_calls_per_tenant: int = setting(32, "of those, one tenant's", "calls", positive=True)
    request_seconds: float = setting(10.0, "a call that has not sent its request by then is "
                                           "cancelled", SECONDS, positive=True)
    max_workers: int = setting(32, "registered workers at a time", "workers", positive=True)
    max_prompt_pages: int = setting(1 << 16, "keys in one request", "keys", positive=True)
    min_entry_bytes: int = setting(64, "smaller KV pages or checkpoints are refused at "
                                       "registration", BYTES, positive=True)
    grace_seconds: float = setting(10.0, "for calls in flight at shutdown", SECONDS)
    flush_on_exit: bool = setting(True, "write host entries to disk when stopping")
    cpus: str = setting("", "CPUs the daemon's threads run on, e.g. 0-3 (keep them apart from the "
                            "workers'); \"\": any")
    spin: bool = setting(False, "keep the cpus out of idle: a busy thread of the lowest priority on "
                                "each (their power, always; calls skip waking an idle CPU)")
    # who may call, and how (service/auth.py, service/tls.py, tiercache/tenancy.py)
    tenants_file: str = setting("", "TOML naming tenants, their tokens and certificate names "
                                    "(README: Tenants); \"\": one tenant")
    socket_tenant: str = setting("", "the tenant of Unix-socket callers that bring no token")
    require_identity: bool = setting(False, "Unix-socket callers need a token too")
    hash: str = setting("", "the page hash every worker must use (\"\": the worker's choice); "
                            "blake2b_128 where tenants share a namespace", choices=tuple(HASHES))
    max_workers_per_tenant: int = setting(0, "registrations one tenant may hold (0: no limit "
                                             "but max_workers)", "workers")
    tls_cert: str = setting("", "PEM certificate for the TCP port; \"\": plaintext")
    tls_key: str = setting("", "PEM private key of tls_cert")
    tls_client_ca: str = setting("", "PEM CA: TCP clients must present a certificate it signed "
                                     "(mTLS); \"\": any client")
    tcp_insecure: bool = setting(False, "allow plaintext TCP on an address other machines can "
                                        "reach (refused otherwise)")
    # operations: metrics, probes, logs (README: Operations)
    metrics_address: str = setting("127.0.0.1:9477", "host:port of Prometheus /metrics over HTTP; "
                                                     "\"\": off, port 0: any free port")
    health_address: str = setting("", "host:port of a plaintext gRPC listener serving health "
                                      "only, for Kubernetes probes; \"\": off")
    drain_seconds: float = setting(0.0, "after SIGTERM, health says NOT_SERVING while calls are "
                                        "still answered, then grace_seconds", SECONDS)
    log_format: str = setting("text", "text, or json (one object a line)",
                              choices=("text", "json"))
    log_level: str = setting("info", "debug logs every call",
                             choices=("debug", "info", "warning", "error"))
    secret_file: str = setting("", "masks keys per namespace; daemons share entries only if they "
                                   "share it; \"\": <data_dir>/secret")
    # past one node (README: Past one node): a shared remote tier, KV events for routers
    remote: str = setting("", "the shared remote tier, redis-cluster://host:port[,host:port...]; "
                              "\"\": none")
    remote_namespace: str = setting("", "prefix of this daemon's keys in the remote tier; \"\": "
                                        "derived from the secret (daemons sharing it share entries)")
    remote_lookup_seconds: float = setting(0.05, "a Match's budget for the remote tier", SECONDS)
    remote_writes: str = setting("through", "when entries go to the remote tier: behind each store "
                                            "(through), or as they leave this node (evict)",
                                 choices=("through", "evict"))
    remote_local_tenants: str = setting("", "comma-separated tenants whose entries never leave "
                                            "this node")
    remote_local_models: str = setting("", "comma-separated models whose entries never leave "
                                           "this node")
    kv_events: str = setting("", "ZMQ PUB endpoint for routers, e.g. tcp://*:5557; \"\": no KV "
                                 "events")
    kv_events_replay: str = setting("", "ZMQ ROUTER endpoint for replays, e.g. tcp://*:5558")
    kv_events_pod: str = setting("", "the topic's pod part (kv@<pod>@<model>); \"\": "
                                     "<hostname>:<port>")
    kv_events_tenant: str = setting("", "whose stores are published; \"\": the socket tenant's, "
                                        "\"*\": every tenant's")

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
        for s in SETTINGS:
            value = getattr(self, s.name)
            problem = s.problem(value)
            if problem:
                raise InvalidArgument(f"{problem}, got {value!r}")
        self.engine()  # the engine's own checks (the policy's too)
        tls.check(self.tcp, self.tls_cert, self.tls_key, self.tls_client_ca, self.tcp_insecure)
        for name in ("metrics_address", "health_address"):
            if getattr(self, name):
                host_port(getattr(self, name), name)
        self.kv_events_config()
        if self.cpus:
            parse_cpus(self.cpus)
        elif self.spin:
            raise InvalidArgument("spin needs cpus: name the CPUs to keep out of idle, e.g. --cpus 0-3")
        return self


SETTINGS = declared(ServiceConfig)
_BY_NAME = {s.name: s for s in SETTINGS}


def read_toml(path: str, what: str) -> dict[str, Any]:
    """A TOML file's tables; a file that is missing or not TOML says so in one line, with
    the line that is wrong."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode()
        return tomllib.loads(text)
    except OSError as error:
        raise InvalidArgument(f"{what} {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidArgument(f"{what} {path} is not TOML: it is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        at = re.search(r"at line (\d+)", str(error))
        lines = text.splitlines()
        wrong = lines[int(at.group(1)) - 1].strip() if at and int(at.group(1)) <= len(lines) else ""
        raise InvalidArgument(f"{what} {path} is not valid TOML ({error})"
                              f"{f' {wrong!r}' if wrong else ''}: fix that line") from None


def host_port(address: str, setting: str) -> tuple[str, int]:
    """"127.0.0.1:9477", "[::1]:9477", "0.0.0.0:0" -> (host, port)."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"{setting}={address!r} is not host:port: write e.g. 127.0.0.1:9477")
    return host.removeprefix("[").removesuffix("]"), int(port)


# TIERCACHE_* variables that are not settings: the config file's path, fault injection
# (tiercache.failpoints), the per-step trace (tiercache.trace), and what workers' clients read
_NOT_SETTINGS = {"TIERCACHE_CONFIG", "TIERCACHE_FAILPOINTS", "TIERCACHE_ADDRESS", "TIERCACHE_TOKEN",
                 "TIERCACHE_HANDOVER", "TIERCACHE_TRACE", "TIERCACHE_TRACE_SYNC"}
# What Kubernetes sets in every container of a namespace with a Service named tiercache
# (or tiercache-<x>): TIERCACHE_PORT=tcp://10.0.0.1:9477, TIERCACHE_SERVICE_HOST, and
# TIERCACHE_PORT_9477_TCP_ADDR and friends. No setting may have a name of this form (a test
# keeps it so): these variables are never read as settings, only warned about.
SERVICE_LINK = re.compile(r"TIERCACHE_(\w+_)?(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_\w+)?)")


def _environment(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The settings among the TIERCACHE_* variables, and the names of the others."""
    found = {k: v for k, v in environ.items()
             if k.startswith("TIERCACHE_") and k not in _NOT_SETTINGS}
    settings = {s.env: s.name for s in SETTINGS}
    return ({settings[k]: v for k, v in found.items() if k in settings},
            sorted(k for k in found if k not in settings))


def environment_warning(environ: Mapping[str, str] = os.environ) -> str | None:
    """One line about the TIERCACHE_* variables that are not settings (they are ignored):
    Kubernetes' service links, and what looks like a misspelt setting."""
    ignored = _environment(environ)[1]
    if not ignored:
        return None
    links = [k for k in ignored if SERVICE_LINK.fullmatch(k)]
    said = [", ".join(links) + " (Kubernetes service links: enableServiceLinks: false in the pod "
            "spec stops them)"] if links else []
    for name in (k for k in ignored if k not in links):
        close = difflib.get_close_matches(name, [s.env for s in SETTINGS], n=1)
        said.append(name + (f" (did you mean {close[0]}?)" if close else ""))
    return "ignoring environment variables that are not settings: " + "; ".join(said)


def load(path: str | None = None, environ: Mapping[str, str] = os.environ,
         flags: Mapping[str, Any] | None = None) -> ServiceConfig:
    """Defaults < TOML file < TIERCACHE_* environment < flags. TIERCACHE_* variables that
    are not settings are left alone (environment_warning names them)."""
    layers = [(Source("file", path), read_toml(path, "--config"))] if path else []
    layers.append((Source("environment"), _environment(environ)[0]))
    layers.append((Source("flags"), {k: v for k, v in (flags or {}).items() if v is not None}))
    config = ServiceConfig()
    for source, given in layers:
        config = dataclasses.replace(config, **source.values(given, _BY_NAME))
    return config.check()


def help_line(s: Setting) -> str:
    """One line of --help: what the setting does, its unit, default and variable."""
    unit = "bytes (or 512MiB, 4GiB); " if s.unit == BYTES else f"{s.unit}; " if s.unit else ""
    return f"{s.help} [{unit}default {s.text(s.default)}; env {s.env}]"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One --flag per setting; unset flags leave the file and environment in charge."""
    parser.add_argument("--config", default=os.environ.get("TIERCACHE_CONFIG"),
                        help="TOML file with settings (any of those below, by name) "
                             "[env TIERCACHE_CONFIG]")
    for s in SETTINGS:
        line = help_line(s).replace("%", "%%")  # argparse formats help with %
        if s.kind is bool:
            parser.add_argument(s.flag, dest=s.name, default=None, help=line,
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(s.flag, dest=s.name, default=None, metavar=_metavar(s), help=line)


def _metavar(s: Setting) -> str:
    if s.choices:
        return "{" + ",".join(s.choices) + "}"
    if s.unit in (BYTES, SECONDS):
        return {BYTES: "SIZE", SECONDS: "SECONDS"}[s.unit]
    return {int: "N", float: "X"}.get(s.kind, s.name.upper())


def markdown_table() -> str:
    """The README's table of settings."""
    def cell(text: str) -> str:  # <data_dir> is no HTML tag, tcp://*:5557 no emphasis
        return text.replace("<", "\\<").replace("*", "\\*")
    rows = [f"| `{s.name}` | `{s.text(s.default)}` | {', '.join(s.choices) or s.unit} | "
            f"{cell(s.help)} |" for s in SETTINGS]
    return "\n".join(["| setting | default | unit or values | what |", "| --- | --- | --- | --- |",
                      *rows])
