"""Keeping namespaces apart below the wire: a per-namespace mask on every key.

The daemon derives each worker's namespace root from its tenant, model, layout
fingerprint, extra keys and hash, so honest workers of two namespaces never compute the
same keys. But the daemon never sees tokens: a worker may send any keys, those of
another namespace included (another tenant's, or its own under another layout, whose
entries have other sizes). So the daemon XORs every key a worker sends with a 128-bit
mask derived from a secret only the daemon knows and the worker's namespace root
(HMAC-SHA256): engine keys of two namespaces differ even for the same key on the wire,
and no worker can compute the engine keys of a namespace it is not registered in
(invariant 5). XOR is a bijection per namespace (distinct keys stay distinct) and costs
one vectorised pass over the (n, 2) uint64 key array.

The secret lives in the data directory beside the disk tier (mode 0600): the disk holds
masked keys, so a new secret makes the old entries unreachable (misses, then evicted).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat

import numpy as np

from tiercache.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("tiercache")

SECRET_BYTES = 32
_TAG = b"tiercache/namespace-mask/v2\0"


def namespace_mask(secret: bytes, root: bytes) -> np.ndarray:
    """The mask of the namespace whose root is `root` (Namespace.root(): it covers the
    tenant, model, layout and extra keys), as a uint64 pair to XOR with keys (n, 2)."""
    digest = hmac.new(secret, _TAG + bytes(root), hashlib.sha256).digest()
    return np.frombuffer(digest[:16], "<u8").copy()


def masked(keys: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Keys as the engine sees them (and, applied again, as the worker sent them)."""
    flat = np.ascontiguousarray(keys).reshape(-1)
    # one pass over both halves against the mask repeated as bytes: broadcasting the pair
    # costs 4x more, np.tile 2x (2,048 keys: 11, 5.5 and 2.7 us on the 2-core machine)
    return np.bitwise_xor(flat, np.frombuffer(mask.tobytes() * len(keys), "<u8")).reshape(-1, 2)


def load_secret(path: str) -> bytes:
    """The daemon's secret at `path`, created (0600) on first use: written whole to a
    temporary file, then linked into place, so a crash never leaves half a secret."""
    if not os.path.exists(path):
        temporary = f"{path}.{os.getpid()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, os.urandom(SECRET_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temporary, path)  # never replaces a secret another start wrote first
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
    check_private(path, "secret")
    with open(path, "rb") as f:
        secret = f.read()
    if len(secret) != SECRET_BYTES:
        raise FailedPrecondition(f"{path} is not a tiercache secret ({len(secret)} bytes, not "
                                 f"{SECRET_BYTES}): restore it, or delete it to start afresh "
                                 "(cached entries become unreachable)")
    return secret


def check_private(path: str, what: str) -> os.stat_result:
    """Refuse a file or directory that another user owns or that others may write (they
    could name tenants, tokens or keys of their choosing); warn if others may read it."""
    try:
        found = os.stat(path)
    except OSError as error:
        raise InvalidArgument(f"{what} {path}: {error.strerror}") from None
    if found.st_uid not in (os.getuid(), 0):
        raise InvalidArgument(f"{what} {path} belongs to user {found.st_uid}, not to the daemon's "
                              f"user {os.getuid()}: chown it")
    if found.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise InvalidArgument(f"{what} {path} may be written by others: chmod go-w it")
    if not stat.S_ISDIR(found.st_mode) and found.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("%s %s is readable by others: chmod 600 it", what, path)
    return found
