"""How a caller reaches the daemon: its address (given, else $TIERCACHE_ADDRESS, else the
default socket), TLS for TCP, the token sent with every call ($TIERCACHE_TOKEN), and the
gRPC channel. Plain gRPC, no torch or numpy: `tiercache stats` connects through this
alone and starts in a fraction of a second; the worker's client (client.py) builds on it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc

DEFAULT_ADDRESS = "unix:./tiercache-data/tiercache.sock"


@dataclass(frozen=True)
class Tls:
    """TLS for a TCP connection: the CA that signed the daemon's certificate, and for mTLS
    this worker's certificate and key (PEM files)."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""  # the name in the daemon's certificate, if not the address's host

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str) -> bytes | None:
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()
        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file),
                                            read(self.cert_file))


@dataclass(frozen=True)
class Connection:
    address: str
    channel: grpc.Channel
    metadata: tuple[tuple[str, str], ...]  # sent with every call: the token, if any


def connect(address: str | None = None, max_message_bytes: int = 16 << 20,
            token: str | None = None, tls: Tls | None = None) -> Connection:
    """A channel to the daemon (it connects on the first call)."""
    address = address or os.environ.get("TIERCACHE_ADDRESS", DEFAULT_ADDRESS)
    token = token if token is not None else os.environ.get("TIERCACHE_TOKEN", "")
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes),
               # a restarted daemon is found within a second, not gRPC's two minutes
               ("grpc.initial_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    channel = (grpc.secure_channel(address, tls.credentials(), options) if tls is not None
               else grpc.insecure_channel(address, options))
    return Connection(address, channel, (("authorization", f"Bearer {token}"),) if token else ())
