"""TLS for the TCP listener: server certificate always, client certificates (mTLS) when a
client CA is configured. The Unix socket needs none: only the daemon's user can reach it."""

from __future__ import annotations

import ipaddress

import grpc

from tiercache.errors import InvalidArgument


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as error:
        raise InvalidArgument(f"cannot read {path}: {error.strerror}") from None


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials:
    """Credentials for the TCP port: this certificate and key (PEM); with `client_ca`,
    every client must present a certificate that CA signed."""
    return grpc.ssl_server_credentials([(_read(key), _read(cert))],
                                       root_certificates=_read(client_ca) if client_ca else None,
                                       require_client_auth=bool(client_ca))


def is_loopback(address: str) -> bool:
    """Whether `host:port` listens on this machine only."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check(tcp: str, cert: str, key: str, client_ca: str, insecure: bool) -> None:
    """Refuse TLS settings that cannot work, and plaintext TCP beyond this machine unless
    asked for by name."""
    if bool(cert) != bool(key):
        raise InvalidArgument("tls_cert and tls_key go together: give both or neither")
    if client_ca and not cert:
        raise InvalidArgument("tls_client_ca (mTLS) needs tls_cert and tls_key as well")
    if tcp and not cert and not insecure and not is_loopback(tcp):
        raise InvalidArgument(f"tcp {tcp} is reachable from other machines: set tls_cert and "
                              "tls_key (and tls_client_ca for mTLS), or tcp_insecure = true")
