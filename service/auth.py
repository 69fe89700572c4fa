"""Who is calling: the tenant comes from the connection, never from a message.

Three ways to be someone, tried in this order:
  1. a token, as `authorization: Bearer TOKEN` metadata, that the tenants file lists;
  2. an mTLS client certificate (TCP with --tls-client-ca) whose common name the tenants
     file lists;
  3. the Unix socket: its file mode (0600) lets only the daemon's own user connect, and
     grpc-python shows a server nothing more of a Unix peer (no SO_PEERCRED uid: the peer
     is "unix:", the auth context says only "insecure"), so every such caller is one
     tenant, `socket_tenant` (unless `require_identity` asks for a token there too).
Without a tenants file everyone is the default tenant "" (one trust domain).

A tenants file (TOML, keep it 0600):

    [tenants.acme]
    tokens = ["sha256:9f86d081...", "a-raw-token"]   # SHA-256 digests (hex) or tokens
    common_names = ["worker.acme.internal"]
    hash = "blake2b_128"   # optional: the page hash this tenant's workers must use

Tokens are compared as SHA-256 digests with hmac.compare_digest, against every token the
file lists, so the time a check takes says nothing about how close a guess came.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import grpc

from tiercache_service.config import read_toml
from tiercache.tenancy import check_private
from tiercache.errors import InvalidArgument, PermissionDenied, Unauthenticated
from tiercache.hashing import HASHES

log = logging.getLogger("tiercache.service")


@dataclass(frozen=True)
class Identity:
    tenant: str
    principal: str  # which credential: "token:<tenant>#<n>", "cert:<common name>", "socket"


@dataclass(frozen=True)
class Tenant:
    name: str
    token_digests: tuple[bytes, ...] = ()
    common_names: tuple[str, ...] = ()
    hash: str = ""  # "" lets the worker choose


def _digest(token: str) -> bytes:
    if token.startswith("sha256:"):
        try:
            digest = bytes.fromhex(token[len("sha256:"):])
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise InvalidArgument(f"tenants file: {token[:20]}... is not sha256: and 64 hex digits")
        return digest
    return hashlib.sha256(token.encode()).digest()


def _tenant(name: str, table: Mapping[str, Any]) -> Tenant:
    unknown = set(table) - {"tokens", "common_names", "hash"}
    if unknown:
        raise InvalidArgument(f"tenants file: tenant {name!r} has unknown keys {sorted(unknown)}")
    hash_name = str(table.get("hash", ""))
    if hash_name and hash_name not in HASHES:
        raise InvalidArgument(f"tenants file: tenant {name!r} hash {hash_name!r} is unknown: "
                              f"use one of {sorted(HASHES)}")
    for key in ("tokens", "common_names"):
        value = table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise InvalidArgument(f"tenants file: tenant {name!r} {key} must be a list of "
                                  f'strings, e.g. {key} = ["..."]')
    return Tenant(name, tuple(_digest(t) for t in table.get("tokens", [])),
                  tuple(table.get("common_names", [])), hash_name)


def load_tenants(path: str) -> dict[str, Tenant]:
    """The tenants a TOML file names (see the module doc); {} for no file."""
    if not path:
        return {}
    check_private(path, "tenants file")
    tables = read_toml(path, "tenants file").get("tenants", {})
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise InvalidArgument(f"tenants file {path}: write one [tenants.NAME] table per tenant")
    tenants = {name: _tenant(name, table) for name, table in tables.items()}
    names = [cn for t in tenants.values() for cn in t.common_names]
    if len(names) != len(set(names)):
        raise InvalidArgument("tenants file: a certificate common name is listed for two tenants")
    digests = [d for t in tenants.values() for d in t.token_digests]
    if len(digests) != len(set(digests)):
        raise InvalidArgument("tenants file: a token is listed twice (for two tenants, or twice "
                              "for one): give each its own")
    return tenants


class Authenticator:
    def __init__(self, tenants: Mapping[str, Tenant], socket_tenant: str = "",
                 require_identity: bool = False, required_hash: str = "") -> None:
        self.tenants = dict(tenants)
        self.socket_tenant = socket_tenant
        self.require_identity = require_identity
        self.required_hash = required_hash  # for every tenant that names none of its own
        self._tokens = [(digest, f"token:{t.name}#{n}", t.name) for t in self.tenants.values()
                        for n, digest in enumerate(t.token_digests)]
        self._names = {cn: t.name for t in self.tenants.values() for cn in t.common_names}

    def hash_of(self, tenant: str) -> str:
        """The page hash a tenant's workers must use ("" if they may choose)."""
        found = self.tenants.get(tenant)
        return (found.hash if found is not None else "") or self.required_hash

    def identify(self, context: grpc.ServicerContext) -> Identity:
        """The caller's identity; raises Unauthenticated or PermissionDenied."""
        if not self.tenants:  # one trust domain: nothing to tell apart
            return Identity("", "anyone")
        token = _bearer(context)
        if token is not None:
            return self._by_token(token)
        names = (context.auth_context() or {}).get("x509_common_name", [])
        if names:
            name = names[0].decode(errors="replace")
            if name not in self._names:
                raise PermissionDenied(f"client certificate CN={name!r} is not listed for any "
                                       "tenant: add it to the tenants file")
            return Identity(self._names[name], f"cert:{name}")
        if context.peer().startswith("unix:") and not self.require_identity:
            return Identity(self.socket_tenant, "socket")
        raise Unauthenticated("no credentials: send `authorization: Bearer TOKEN` metadata or "
                              "connect with a client certificate")

    def _by_token(self, token: str) -> Identity:
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for known, principal, tenant in self._tokens:  # all of them: no early exit
            if hmac.compare_digest(digest, known):
                found = (principal, tenant)
        if found is None:
            raise Unauthenticated("the token is not valid here: check TIERCACHE_TOKEN")
        return Identity(found[1], found[0])


def _bearer(context: grpc.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise Unauthenticated("authorization metadata must read `Bearer TOKEN`")
            return token.strip()
    return None
