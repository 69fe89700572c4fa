"""Worker buffers in sealed shared memory, handed to the daemon as a file descriptor, so
the daemon can copy rows without a copy through gRPC.

The worker creates one anonymous memory file (memfd) holding all buffers of its layout,
each at an aligned offset, and seals it against shrinking and growing: no process can
change its size while the daemon has it mapped (a shrunk mapping would end the daemon
with SIGBUS on its next copy). It has no name: nothing in /dev/shm can be guessed,
replaced by a symlink or opened by another worker. The worker passes the descriptor over
a Unix socket beside the gRPC one (SCM_RIGHTS); the daemon checks it is a sealed memfd,
maps it, closes the descriptor and answers with a ticket, 16 random bytes that only the
worker learns. A registration names its buffers by ticket and offset.

The handover protocol, both ends:
    worker -> daemon: MAGIC with one descriptor attached
    daemon -> worker: b"OK" + ticket (16 bytes), or b"NO" + a message saying what to fix
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import socket
import stat
import weakref
from dataclasses import dataclass

import torch

from tiercache.errors import FailedPrecondition, InvalidArgument, Unavailable
from tiercache.layout import BufferSpec, Layout

MAGIC = b"tiercache-memfd/1"
TICKET_BYTES = 16
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_ALIGN = 4096
_REPLY_BYTES = 512


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared(fd: int, size: int) -> ctypes.Array:
    """`size` bytes of `fd` mapped shared and writable, as a buffer that unmaps itself when
    its last user (the tensors viewing it) is gone. Unlike mmap.mmap, it keeps no copy of
    the descriptor: the caller closes `fd`, and a registration holds no descriptor."""
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed: {os.strerror(ctypes.get_errno())}")
    mapping = (ctypes.c_uint8 * size).from_address(address)
    weakref.finalize(mapping, _libc.munmap, address, size)
    return mapping


def _tensor(mapping: ctypes.Array, spec: BufferSpec, offset: int) -> torch.Tensor:
    nbytes = spec.rows * spec.row_bytes
    raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(getattr(torch, spec.dtype)).view(spec.shape)


@dataclass(frozen=True)
class Placement:
    """Where one buffer lies in the shared object."""

    spec: BufferSpec
    offset: int

    @property
    def nbytes(self) -> int:
        return self.spec.rows * self.spec.row_bytes


def plan(layout: Layout) -> tuple[list[Placement], int]:
    """Aligned offsets for every buffer of `layout`, and the object's total size."""
    placements, at = [], 0
    for spec in (*layout.paged, *layout.slots):
        placements.append(Placement(spec, at))
        at += -(-spec.rows * spec.row_bytes // _ALIGN) * _ALIGN
    return placements, at


class SharedBuffers:
    """The worker's side: a sealed memfd holding the layout's buffers, as tensors."""

    def __init__(self, fd: int, mapping: ctypes.Array, placements: list[Placement]) -> None:
        self.fd: int | None = fd  # kept until handed over
        self.placements = placements
        self._mapping = mapping
        self.tensors = {p.spec.name: _tensor(mapping, p.spec, p.offset) for p in placements}

    @classmethod
    def create(cls, layout: Layout) -> "SharedBuffers":
        placements, size = plan(layout)
        return cls(*sealed(size, "tiercache-buffers"), placements)

    def hand_over(self, path: str) -> bytes:
        """Pass the memfd to the daemon listening on `path`; its ticket. The descriptor is
        closed either way: the mapping keeps the memory."""
        assert self.fd is not None, "handed over already"
        try:
            return hand_over(path, self.fd)
        finally:
            self.close_fd()

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        """Drop this side's view; the memory goes once the daemon's mapping is gone too."""
        self.close_fd()
        self.tensors = {}


def sealed(size: int, name: str) -> tuple[int, ctypes.Array]:
    """A new memfd of `size` zeroed bytes, sealed against shrinking and growing, and its
    shared mapping."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
        return fd, map_shared(fd, size)
    except BaseException:
        os.close(fd)
        raise


def hand_over(path: str, fd: int, timeout: float = 10.0) -> bytes:
    """The worker's end of the handover: send `fd` to the daemon at `path`, get a ticket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        try:
            conn.connect(path)
            socket.send_fds(conn, [MAGIC], [fd])
            reply = _read_reply(conn)
        except (FileNotFoundError, ConnectionRefusedError):
            raise Unavailable(f"no tiercache daemon takes buffers at {path}: is it running, and "
                              "is this its socket (pass handover= to Client otherwise)?") from None
        except OSError as error:
            raise Unavailable(f"handing the buffers to the daemon at {path} failed: {error}") from None
    if reply.startswith(b"OK") and len(reply) == 2 + TICKET_BYTES:
        return reply[2:]
    raise FailedPrecondition("the daemon refused the buffers: "
                             + reply[2:].decode(errors="replace"))


def _read_reply(conn: socket.socket) -> bytes:
    reply = b""
    while len(reply) < _REPLY_BYTES:
        part = conn.recv(_REPLY_BYTES - len(reply))
        if not part:
            break
        reply += part
    return reply


def map_sealed(fd: int, max_bytes: int) -> ctypes.Array:
    """The daemon's end: map a descriptor a worker sent, if it is a sealed memfd of a sane
    size (raises InvalidArgument otherwise). The caller closes `fd`; the mapping stays."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise InvalidArgument("the descriptor is not a memory file: create buffers with "
                              "tiercache.shm.SharedBuffers (a sealed memfd)")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise InvalidArgument("the descriptor is not a memfd that can be sealed: create it with "
                              "memfd_create(MFD_ALLOW_SEALING)") from None
    if seals & SEALS != SEALS:
        raise InvalidArgument("the memfd is not sealed against shrinking and growing: add "
                              "F_SEAL_SHRINK | F_SEAL_GROW before handing it over")
    if not 0 < info.st_size <= max_bytes:
        raise InvalidArgument(f"the memfd holds {info.st_size} bytes: give 1 to {max_bytes}")
    return map_shared(fd, info.st_size)


def attach(layout: Layout, where: dict[str, tuple[ctypes.Array, int]]) -> dict[str, torch.Tensor]:
    """The daemon's side: view every buffer of `layout` at its (mapping, offset) in `where`."""
    tensors = {}
    for spec in (*layout.paged, *layout.slots):
        mapping, offset = where[spec.name]
        if offset < 0 or offset + spec.rows * spec.row_bytes > len(mapping):
            raise InvalidArgument(f"buffer {spec.name!r} at offset {offset} runs past the end of "
                                  f"its shared memory ({len(mapping)} bytes)")
        tensors[spec.name] = _tensor(mapping, spec, offset)
    return tensors
