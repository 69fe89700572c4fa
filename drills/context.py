"""What a servicer sees of a call, made up: credentials, peer, deadline, callbacks and an
abort that raises `Aborted` (the servicer tests and the fuzzer call the servicer
in-process with it, behind the daemon's own error interceptor)."""

from __future__ import annotations

import grpc


class Aborted(Exception):
    pass


class Context:
    """A call as a test or the fuzzer chose it; `end()` runs its callbacks, as a stream
    that ends does."""

    def __init__(self, metadata: tuple = (), peer: str = "unix:", names: tuple[bytes, ...] = (),
                 remaining: float | None = None) -> None:
        self.metadata, self.peer_name, self.names, self.remaining = metadata, peer, names, remaining
        self.callbacks: list = []
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self):
        return self.metadata

    def peer(self) -> str:
        return self.peer_name

    def auth_context(self) -> dict:
        return {"x509_common_name": self.names} if self.names else {}

    def time_remaining(self):
        return self.remaining

    def is_active(self) -> bool:
        return True

    def cancel(self) -> None:  # a worker's newer Calls stream ends this one: nothing to end here
        pass

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)

    def end(self) -> None:
        for callback in self.callbacks:
            callback()
