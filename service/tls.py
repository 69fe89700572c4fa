"""TLS for the TCP listener: server certificate always, client certificates (mTLS) when a
client CA is configured. The Unix socket needs none: only the daemon's user can reach it."""

from __future__ import annotations

import ipaddress
import logging
import os
import ssl
import stat

import grpc

from tiercache.errors import InvalidArgument

log = logging.getLogger("tiercache.service")


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
    if cert:
        check_files(cert, key, client_ca)


def check_files(cert: str, key: str, client_ca: str) -> None:
    """Say which file is wrong before grpc can only say "Failed to bind"."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for path in (cert, key, client_ca):
        if path:
            _read(path)  # exists and is readable
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as error:
        raise InvalidArgument(f"tls_cert {cert} and tls_key {key} do not make a certificate and "
                              f"its private key in PEM ({error.reason or error}): check that the "
                              "key belongs to the certificate") from None
    if client_ca:
        try:
            context.load_verify_locations(client_ca)
        except ssl.SSLError as error:
            raise InvalidArgument(f"tls_client_ca {client_ca} is not a PEM CA certificate "
                                  f"({error.reason or error})") from None
    if os.stat(key).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("TLS key %s is readable by others: chmod 600 it", key)
