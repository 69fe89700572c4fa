"""Registered workers: their namespace, their layout and the daemon's view of their
buffers. A registration is used by many calls at once and removed only when none is
using it, so no copy ever runs on an unmapped buffer."""

from __future__ import annotations

import secrets
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from tiercache import shm
from tiercache.buffers import WorkerBuffers
from tiercache.errors import InvalidArgument, NotFound, ResourceExhausted
from tiercache.hashing import Namespace, PageKey
from tiercache.layout import Layout
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import layout_from_proto


@dataclass
class Registration:
    id: str
    namespace: Namespace
    root: PageKey
    buffers: WorkerBuffers | None
    active: int = 0
    gone: threading.Event = field(default_factory=threading.Event)

    @property
    def layout(self) -> Layout:
        assert self.buffers is not None
        return self.buffers.layout


def map_buffers(layout: Layout, locations: Sequence[pb.BufferLocation]) -> WorkerBuffers:
    """The daemon's tensors over a worker's buffers, checked against its layout."""
    specs = {b.name: b for b in (*layout.paged, *layout.slots)}
    names = [location.name for location in locations]
    if sorted(names) != sorted(specs):
        raise InvalidArgument(f"buffer locations {sorted(names)} do not match the layout's "
                              f"buffers {sorted(specs)}: give exactly one location per buffer")
    where = {}
    for location in locations:
        spec = specs[location.name]
        if location.nbytes != spec.rows * spec.row_bytes:
            raise InvalidArgument(f"buffer {spec.name!r}: location says {location.nbytes} bytes, the "
                                  f"layout needs {spec.rows * spec.row_bytes}")
        if location.WhichOneof("where") != "shm":
            raise InvalidArgument(f"buffer {spec.name!r}: no location given (shm)")
        where[spec.name] = (location.shm.name, int(location.shm.offset))
    tensors: dict[str, torch.Tensor] = shm.attach(layout, where)
    return WorkerBuffers.bind(layout, {b.name: tensors[b.name] for b in layout.paged},
                              {b.name: tensors[b.name] for b in layout.slots})


class WorkerRegistry:
    def __init__(self, max_workers: int) -> None:
        self.max_workers = max_workers
        self._workers: dict[str, Registration] = {}
        self._changed = threading.Condition()

    def __len__(self) -> int:
        return len(self._workers)

    def add(self, request: pb.RegisterRequest, tenant: str) -> Registration:
        if not request.model_id:
            raise InvalidArgument("model_id is empty: name the model whose bytes these are")
        layout = layout_from_proto(request.layout)
        namespace = Namespace(request.model_id, layout.fingerprint, tenant,
                              tuple(request.extra_keys), request.hash or "xxh3_128")
        buffers = map_buffers(layout, request.buffers)
        registration = Registration(secrets.token_hex(12), namespace, namespace.root(), buffers)
        with self._changed:
            if len(self._workers) >= self.max_workers:
                raise ResourceExhausted(f"{self.max_workers} workers are registered already: "
                                        "unregister one or raise --max-workers")
            self._workers[registration.id] = registration
        return registration

    @contextmanager
    def use(self, worker_id: str) -> Iterator[Registration]:
        with self._changed:
            registration = self._workers.get(worker_id)
            if registration is None:
                raise NotFound(f"worker {worker_id!r} is not registered (it unregistered, its "
                               "registration stream closed, or the daemon restarted): register again")
            registration.active += 1
        try:
            yield registration
        finally:
            with self._changed:
                registration.active -= 1
                self._changed.notify_all()

    def remove(self, worker_id: str) -> bool:
        """Forget a worker once no call uses it; its mappings go with the last reference."""
        with self._changed:
            registration = self._workers.pop(worker_id, None)
            if registration is None:
                return False
            while registration.active:
                self._changed.wait()
            registration.buffers = None
        registration.gone.set()
        return True

    def remove_all(self) -> None:
        for worker_id in list(self._workers):
            self.remove(worker_id)
