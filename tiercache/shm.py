"""Worker buffers in POSIX shared memory, so the daemon can copy rows without a copy
through gRPC.

The worker creates one shared-memory object holding all buffers of its layout, each at
an aligned offset; the daemon opens the same object by name and maps it. Objects are
created with mode 0600: only the worker's own user (and root) can map them. The worker
owns the object and unlinks it when it closes; a daemon mapping never outlives its
registration.
"""

from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass

import torch

from tiercache.errors import InvalidArgument, NotFound
from tiercache.layout import BufferSpec, Layout

SHM_DIR = "/dev/shm"
_ALIGN = 4096


def _path(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise InvalidArgument(f"shared-memory name {name!r} is not a plain object name")
    return os.path.join(SHM_DIR, name)


def _tensor(mapping: mmap.mmap, spec: BufferSpec, offset: int) -> torch.Tensor:
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
    """The worker's side: creates the object, exposes its buffers as tensors."""

    def __init__(self, name: str, mapping: mmap.mmap, placements: list[Placement]) -> None:
        self.name = name
        self.placements = placements
        self._mapping = mapping
        self.tensors = {p.spec.name: _tensor(mapping, p.spec, p.offset) for p in placements}

    @classmethod
    def create(cls, layout: Layout, prefix: str = "tiercache") -> "SharedBuffers":
        placements, size = plan(layout)
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, mapping, placements)

    def close(self) -> None:
        """Unlink the object; the memory goes once every mapping of it is gone."""
        self.tensors = {}
        try:
            os.unlink(_path(self.name))
        except FileNotFoundError:
            pass


def attach(layout: Layout, where: dict[str, tuple[str, int]]) -> dict[str, torch.Tensor]:
    """The daemon's side: map each worker object once and view every buffer of `layout`
    at its (object name, offset) in `where`."""
    mappings: dict[str, mmap.mmap] = {}
    tensors = {}
    for spec in (*layout.paged, *layout.slots):
        name, offset = where[spec.name]
        if name not in mappings:
            mappings[name] = _map(name)
        size = len(mappings[name])
        if offset < 0 or offset + spec.rows * spec.row_bytes > size:
            raise InvalidArgument(f"buffer {spec.name!r} at offset {offset} runs past the end of "
                                  f"shared-memory object {name!r} ({size} bytes)")
        tensors[spec.name] = _tensor(mappings[name], spec, offset)
    return tensors


def _map(name: str) -> mmap.mmap:
    try:
        fd = os.open(_path(name), os.O_RDWR)
    except FileNotFoundError:
        raise NotFound(f"shared-memory object {name!r} does not exist: create the buffers "
                       "before registering, and register from the same machine") from None
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
