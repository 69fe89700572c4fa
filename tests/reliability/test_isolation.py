"""Invariant 5: the tenant comes from the caller's credentials, and two tenants never
share a hit, even for the same prompt, even when one knows the other's namespace root.

One daemon: tenants acme and beta in a tenants file (tokens, certificate names), the
Unix socket, and TCP with mTLS on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

import grpc
import pytest

from tiercache_service.auth import Authenticator, Tenant, load_tenants
from tiercache_service.handover import handover_path
from drills import certs, keyed, prompts
from tests.service.daemon import running_daemon
from tiercache.client import Client, Tls
from tiercache.errors import (InvalidArgument, PermissionDenied, TiercacheError, Unauthenticated,
                              Unavailable)
from tiercache.v1 import tiercache_pb2 as pb

# .ci/run installs openssl: CI never skips
pytestmark = pytest.mark.skipif(not certs.available() and not os.environ.get("CI"),
                                reason="needs the openssl command (apt-get install openssl)")

TENANTS = f"""
[tenants.acme]
tokens = ["acme-token-1", "sha256:{hashlib.sha256(b'acme-token-2').hexdigest()}"]
common_names = ["acme-worker"]

[tenants.beta]
tokens = ["beta-token"]
common_names = ["beta-worker"]
hash = "blake2b_128"
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    folder = tmp_path_factory.mktemp("isolation")
    made = certs.make(folder / "certs", ("acme-worker", "beta-worker", "nobody-worker"))
    (folder / "tenants.toml").write_text(TENANTS)
    (folder / "tenants.toml").chmod(0o600)
    tcp = f"127.0.0.1:{free_port()}"
    with running_daemon(folder / "data", "--tenants-file", str(folder / "tenants.toml"),
                        "--tcp", tcp, "--tls-cert", str(made.server[0]), "--tls-key",
                        str(made.server[1]), "--tls-client-ca", str(made.ca)) as (address, _):
        # workers that connect over TCP hand their buffers over on the socket beside
        os.environ["TIERCACHE_HANDOVER"] = handover_path(address.removeprefix("unix:"))
        try:
            yield address, tcp, made
        finally:
            del os.environ["TIERCACHE_HANDOVER"]


def mtls(made, name: str) -> Tls:
    cert, key = made.clients[name] if name in made.clients else made.stranger
    return Tls(str(made.ca), str(cert), str(key))


def register(address: str, **credentials):
    return Client(address, timeout=10, **credentials).register(prompts.MODEL, prompts.LAYOUT)


def store(worker, prompt: int) -> None:
    paged, slots = keyed.byte_rows(worker.paged), keyed.byte_rows(worker.slots)
    keyed.fill(paged, slots, worker.keys(prompts.tokens(prompt)), list(range(prompts.PAGES)), 0)
    worker.store(prompts.tokens(prompt), kv_rows=range(prompts.PAGES),
                 checkpoints={prompts.PAGES * prompts.PAGE: 0})


def hits(worker, prompt: int = None, keys=None) -> int:
    """Pages loaded (checked byte for byte against what acme stored)."""
    paged, slots = keyed.byte_rows(worker.paged), keyed.byte_rows(worker.slots)
    keyed.poison(paged), keyed.poison(slots)
    rows = list(range(prompts.PAGES, 2 * prompts.PAGES))
    if keys is None:
        result = worker.load(prompts.tokens(prompt), kv_rows=rows, slot=1)
        keys = worker.keys(prompts.tokens(prompt))
    else:
        result = worker.load(keys=keys, kv_rows=rows, slot=1)
    assert keyed.wrong_entries(paged, slots, keys, rows, result.match.pages, 1) == 0
    return result.match.pages


def test_the_same_tenant_hits_and_another_tenant_gets_nothing_for_the_same_prompt(daemon):
    address, _, _ = daemon
    acme = register(address, token="acme-token-1")
    store(acme, 1)
    # another acme worker, with acme's other token: the whole prompt hits
    assert hits(register(address, token="acme-token-2"), 1) == prompts.PAGES
    # beta, and callers on the socket without a token, send the same prompt: 0 pages
    assert hits(register(address, token="beta-token"), 1) == 0
    assert hits(register(address), 1) == 0


def test_knowing_another_tenants_root_does_not_reach_its_entries(daemon):
    address, _, _ = daemon
    acme = register(address, token="acme-token-1")
    store(acme, 2)
    beta = register(address, token="beta-token")
    assert beta.root != acme.root  # the tenant is part of the namespace ...
    # ... and beta sending acme's very keys still misses: the daemon masks keys per tenant
    assert hits(beta, keys=acme.keys(prompts.tokens(2))) == 0
    assert hits(acme, keys=acme.keys(prompts.tokens(2))) == prompts.PAGES


def test_a_worker_can_only_be_used_by_who_registered_it(daemon):
    address, _, _ = daemon
    acme = register(address, token="acme-token-1")
    request = pb.MatchRequest(worker_id=acme._backend._id, keys=b"".join(acme.keys(prompts.tokens(1))))
    beta_client = Client(address, token="beta-token")
    with pytest.raises(grpc.RpcError) as denied:
        beta_client._stub.Match(request, metadata=beta_client._metadata)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # acme's other token is another identity too: a worker keeps the credentials it began with
    other = Client(address, token="acme-token-2")
    with pytest.raises(grpc.RpcError) as denied:
        other._stub.Match(request, metadata=other._metadata)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("metadata", [(("authorization", "Bearer not-a-token"),),
                                      (("authorization", "Basic YWNtZQ=="),)],
                         ids=["unknown token", "not a bearer token"])
def test_bad_tokens_are_unauthenticated(daemon, metadata):
    address, _, _ = daemon
    stub = Client(address)._stub
    with pytest.raises(grpc.RpcError) as refused:
        stub.Stats(pb.StatsRequest(), metadata=metadata)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(Unauthenticated):
        register(address, token="not-a-token")


def test_mtls_certificates_name_the_tenant(daemon):
    address, tcp, made = daemon
    store(register(address, token="acme-token-1"), 3)
    # acme's certificate over TCP is acme: the prompt acme stored on the socket hits
    assert hits(register(tcp, tls=mtls(made, "acme-worker")), 3) == prompts.PAGES
    assert hits(register(tcp, tls=mtls(made, "beta-worker")), 3) == 0
    # a certificate the tenants file does not list is known but not allowed
    with pytest.raises(PermissionDenied, match="nobody-worker"):
        register(tcp, tls=mtls(made, "nobody-worker"))


@pytest.mark.parametrize("how", ["no client certificate", "another CA's certificate", "plaintext"])
def test_tcp_refuses_callers_without_a_trusted_certificate(daemon, how):
    _, tcp, made = daemon
    credentials = {"no client certificate": {"tls": Tls(str(made.ca))},
                   "another CA's certificate": {"tls": mtls(made, "stranger")},
                   "plaintext": {}}[how]
    with pytest.raises(Unavailable):  # the handshake fails: no call ever reaches a servicer
        register(tcp, **credentials)


def test_a_tenant_can_be_made_to_hash_with_blake2b(daemon):
    address, _, _ = daemon
    # beta's workers hash with blake2b whatever they ask for; acme's keep their choice
    assert register(address, token="beta-token").hash_name == "blake2b_128"
    assert register(address, token="acme-token-1").hash_name == "xxh3_128"


def test_tokens_are_checked_against_every_token_in_constant_time(monkeypatch):
    tenants = {f"t{n}": Tenant(f"t{n}", (hashlib.sha256(f"token-{n}".encode()).digest(),))
               for n in range(5)}
    auth = Authenticator(tenants)
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    # the first token matches at once, yet all five are compared: no early exit
    assert auth._by_token("token-0").tenant == "t0"
    assert len(compared) == 5
    with pytest.raises(TiercacheError):
        auth._by_token("token-9")


@pytest.mark.parametrize("body, says", [
    ('[tenants.a]\ntokens = "secret"\n', "list of strings"),  # would be one token per letter
    ('[tenants.a]\ntokens = ["t1"]\n[tenants.b]\ntokens = ["t1"]\n', "listed twice"),
    ('[tenants.a]\ncommon_names = ["w", 3]\n', "list of strings"),
])
def test_a_tenants_file_that_would_grant_the_wrong_tokens_is_refused(tmp_path, body, says):
    path = tmp_path / "tenants.toml"
    path.write_text(body)
    path.chmod(0o600)
    with pytest.raises(InvalidArgument, match=says):
        load_tenants(str(path))
