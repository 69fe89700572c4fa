"""Domain errors. Each says what was wrong and what to do; the service maps the classes
to gRPC status codes in one place (service/errors.py)."""


class TiercacheError(Exception):
    """Base of every error tiercache raises on purpose."""


class InvalidArgument(TiercacheError, ValueError):
    """The caller sent something malformed: bad layout, row id out of range, ..."""


class NotFound(TiercacheError, KeyError):
    """A named thing (worker, buffer) does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class ResourceExhausted(TiercacheError):
    """A budget or limit leaves no room for the request."""


class FailedPrecondition(TiercacheError):
    """The request is well formed but the state does not allow it now."""


class DeadlineExceeded(TiercacheError):
    """The caller's deadline passed before the work could start."""


class Unavailable(TiercacheError):
    """The daemon cannot be reached, or went away."""


class Unauthenticated(TiercacheError):
    """The caller did not say who it is, or said it with credentials the daemon rejects."""


class PermissionDenied(TiercacheError):
    """The caller is known but may not do this (e.g. use another identity's worker)."""
