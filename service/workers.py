"""Registered workers: their namespace, their layout and the daemon's view of their
buffers. A registration is used by many calls at once and removed only when none is
using it, so no copy ever runs on an unmapped buffer."""

from __future__ import annotations

import ctypes
import logging
import secrets
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from tiercache_service.auth import Identity
from tiercache_service.groups import Membership, member_keys, membership_of
from tiercache import cuda_ipc, lane, shm, tenancy
from tiercache.cuda_ipc import OpenedEvents
from tiercache.signals import DaemonSignals
from tiercache.buffers import WorkerBuffers
from tiercache.errors import (FailedPrecondition, InvalidArgument, NotFound, PermissionDenied,
                              ResourceExhausted, TiercacheError)
from tiercache.hashing import Namespace, PageKey
from tiercache.layout import Layout
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import layout_from_proto

log = logging.getLogger(__name__)


@dataclass
class Registration:
    id: str
    namespace: Namespace
    root: PageKey
    buffers: WorkerBuffers | None
    opened: list = field(default_factory=list)  # CUDA IPC allocations to close at the end
    active: int = 0
    gone: threading.Event = field(default_factory=threading.Event)
    identity: Identity = Identity("", "anyone")  # who registered: every call must be them
    handles: frozenset[bytes] = frozenset()  # the CUDA IPC handles its buffers came by
    mask: np.ndarray | None = None  # the namespace's key mask (tiercache.tenancy), if any
    group: Membership | None = None  # the group it is a rank of (service.groups), if any
    events: OpenedEvents = field(default_factory=OpenedEvents)  # its ready events (servicer)
    done_events: list = field(default_factory=list)  # the events its loads hand back (servicer)
    signals: DaemonSignals | None = None  # its signal words (GPU workers whose client sends them)
    calls: Callable[[], None] | None = None  # ends its Calls stream, if one is open (service/calls.py)
    lane: ctypes.Array | None = None  # its lane of calls (tiercache/lane.py), if it gave one

    @property
    def layout(self) -> Layout:
        assert self.buffers is not None
        return self.buffers.layout

    def engine_keys(self, keys: np.ndarray) -> np.ndarray:
        """The keys a worker sent, as the engine stores them for its namespace."""
        return keys if self.mask is None else tenancy.masked(keys, self.mask)


_MAX_ID = 512  # characters of a model id or an extra key
_MAX_EXTRA = 64  # extra keys of one registration


@dataclass(frozen=True)
class Limits:
    """What one registration may bring (invariant 6: bounded everything)."""

    max_buffers: int = 1024  # buffers in one layout
    max_allocations: int = 256  # distinct memfds or CUDA allocations of one registration
    min_entry_bytes: int = 64  # a smaller page or checkpoint costs more to keep than it saves


def check_layout(layout: Layout, limits: Limits) -> None:
    buffers = len(layout.paged) + len(layout.slots)
    if buffers > limits.max_buffers:
        raise InvalidArgument(f"the layout has {buffers} buffers, more than the {limits.max_buffers} "
                              "one worker may register: put several layers in one buffer")
    for what, nbytes in (("KV page", layout.page_bytes), ("checkpoint", layout.checkpoint_bytes)):
        if 0 < nbytes < limits.min_entry_bytes:
            raise InvalidArgument(f"a {what} of this layout is {nbytes} bytes, under the "
                                  f"{limits.min_entry_bytes} bytes an entry must have: such "
                                  "entries cost more to keep than they save")


def map_buffers(layout: Layout, locations: Sequence[pb.BufferLocation], limits: Limits,
                redeem: Callable[[bytes], ctypes.Array]
                ) -> tuple[WorkerBuffers, list[cuda_ipc.Opened]]:
    """The daemon's tensors over a worker's buffers, checked against its layout, and the
    CUDA allocations it opened for them (to close when the worker goes). Shared-memory
    buffers are named by the tickets of their handover (`redeem`)."""
    specs = {b.name: b for b in (*layout.paged, *layout.slots)}
    names = [location.name for location in locations]
    if sorted(names) != sorted(specs):
        raise InvalidArgument(f"buffer locations {sorted(names)} do not match the layout's "
                              f"buffers {sorted(specs)}: give exactly one location per buffer")
    kinds = {location.WhichOneof("where") for location in locations}
    if len(kinds) != 1 or None in kinds:
        raise InvalidArgument(f"buffers must all be in shared memory (shm) or all on one GPU "
                              f"(cuda), got {sorted(str(k) for k in kinds)}")
    for location in locations:
        spec = specs[location.name]
        if location.nbytes != spec.rows * spec.row_bytes:
            raise InvalidArgument(f"buffer {spec.name!r}: location says {location.nbytes} bytes, "
                                  f"the layout needs {spec.rows * spec.row_bytes}")
    shared = kinds == {"shm"}
    allocations = {bytes(loc.shm.ticket if shared else loc.cuda.handle) for loc in locations}
    if len(allocations) > limits.max_allocations:
        raise InvalidArgument(f"the buffers lie in {len(allocations)} allocations, more than the "
                              f"{limits.max_allocations} one worker may register: share fewer, larger "
                              "allocations")
    opened: list[cuda_ipc.Opened] = []
    try:
        if shared:
            mappings = {ticket: redeem(ticket) for ticket in allocations}
            tensors = shm.attach(layout, {loc.name: (mappings[bytes(loc.shm.ticket)], int(loc.shm.offset))
                                          for loc in locations})
        else:
            tensors = _open_cuda(layout, locations, opened)
        buffers = WorkerBuffers.bind(layout, {b.name: tensors[b.name] for b in layout.paged},
                                     {b.name: tensors[b.name] for b in layout.slots})
    except BaseException:
        for allocation in opened:  # nothing kept by a failed registration
            allocation.close()
        raise
    return buffers, opened


def _open_cuda(layout: Layout, locations: Sequence[pb.BufferLocation],
               opened: list[cuda_ipc.Opened]) -> dict[str, torch.Tensor]:
    """Open each CUDA allocation once and view every buffer at its offset."""
    if len({loc.cuda.device_uuid for loc in locations}) != 1:
        raise InvalidArgument("a worker's CUDA buffers must all be on one GPU: register one "
                              "worker per GPU")
    device = cuda_ipc.local_device(locations[0].cuda.device_uuid)
    specs = {b.name: b for b in (*layout.paged, *layout.slots)}
    allocations: dict[bytes, cuda_ipc.Opened] = {}
    tensors = {}
    for location in locations:
        handle = bytes(location.cuda.handle)
        if handle not in allocations:
            allocations[handle] = cuda_ipc.Opened(handle, device)
            opened.append(allocations[handle])
        spec = specs[location.name]
        raw = allocations[handle].view(int(location.cuda.offset), int(location.nbytes))
        tensors[location.name] = raw.view(getattr(torch, spec.dtype)).view(spec.shape)
    return tensors


def _open_signals(request: pb.RegisterRequest, buffers: WorkerBuffers,
                  opened: list[cuda_ipc.Opened]) -> DaemonSignals | None:
    """The worker's signal words (tiercache/signals.py), on the GPU of its buffers."""
    if not request.HasField("signals"):
        return None
    location = request.signals
    if not location.HasField("cuda") or buffers.device.type != "cuda" or \
            cuda_ipc.local_device(location.cuda.device_uuid) != buffers.device.index:
        raise InvalidArgument("signals are GPU memory on the GPU of the worker's buffers: "
                              "give them only with CUDA buffers, on the same GPU")
    handle = bytes(location.cuda.handle)
    allocation = next((a for a in opened if a.handle == handle), None)
    if allocation is None:
        allocation = cuda_ipc.Opened(handle, buffers.device.index)
        opened.append(allocation)
    return DaemonSignals(allocation, int(location.cuda.offset), int(location.nbytes))


class NoHandover:
    """For registries without shared memory (GPU-only or in-process tests)."""

    def redeem(self, ticket: bytes) -> ctypes.Array:
        raise InvalidArgument("this daemon takes no shared-memory buffers")

    def discard(self, ticket: bytes) -> None:
        pass


class Tickets(Protocol):
    def redeem(self, ticket: bytes) -> ctypes.Array: ...
    def discard(self, ticket: bytes) -> None: ...


class WorkerRegistry:
    def __init__(self, max_workers: int, quiesce: Callable[[WorkerBuffers], None],
                 secret: bytes | None = None, max_per_tenant: int = 0,
                 limits: Limits = Limits(), tickets: Tickets = NoHandover()) -> None:
        self.max_workers = max_workers
        self.max_per_tenant = max_per_tenant  # 0: no limit beyond max_workers
        self.limits = limits
        self._secret = secret  # masks keys per namespace (tiercache.tenancy); None: no masks
        self._quiesce = quiesce  # returns once no copy touches these buffers
        self._tickets = tickets  # the mappings shared-memory tickets stand for
        self._workers: dict[str, Registration] = {}
        self._closing: dict[str, Registration] = {}  # removed, their mappings still open
        self._changed = threading.Condition()

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def ipc_allocations(self) -> int:
        """CUDA allocations of workers that the daemon holds open now."""
        with self._changed:
            return sum(len(r.opened) for r in (*self._workers.values(), *self._closing.values()))

    def add(self, request: pb.RegisterRequest, identity: Identity = Identity("", "anyone"),
            hash_name: str = "") -> Registration:
        """Register a worker of `identity`'s tenant; `hash_name`, if given, overrides the
        page hash the worker asked for (the reply tells it which to use). A registration
        that fails keeps nothing: no mapping, no CUDA allocation, no ticket it named."""
        try:
            return self._add(request, identity, hash_name)
        except BaseException:
            for location in request.buffers:
                if location.HasField("shm"):
                    self._tickets.discard(location.shm.ticket)
            raise

    def _add(self, request: pb.RegisterRequest, identity: Identity, hash_name: str) -> Registration:
        if not request.model_id:
            raise InvalidArgument("model_id is empty: name the model whose bytes these are")
        if len(request.model_id) > _MAX_ID or len(request.extra_keys) > _MAX_EXTRA or any(
                len(extra) > _MAX_ID for extra in request.extra_keys):
            raise InvalidArgument(f"model_id and each extra key take at most {_MAX_ID} characters, "
                                  f"and a worker at most {_MAX_EXTRA} extra keys: hash long ones")
        layout = layout_from_proto(request.layout)
        namespace = Namespace(request.model_id, layout.fingerprint, identity.tenant,
                              tuple(request.extra_keys), hash_name or request.hash or "xxh3_128")
        root = namespace.root()  # checks the namespace before any buffer is mapped
        membership = membership_of(request)
        check_layout(layout, self.limits)
        self._check_room(identity.tenant)
        locations = [*request.buffers, *([request.signals] if request.HasField("signals") else [])]
        self._check_handles(locations, identity)
        buffers, opened = map_buffers(layout, request.buffers, self.limits, self._tickets.redeem)
        try:
            signals = _open_signals(request, buffers, opened)
        except BaseException:
            for allocation in opened:
                allocation.close()
            raise
        mask = None if self._secret is None else tenancy.namespace_mask(self._secret, root)
        if membership is not None:  # hashes from the group's root; its own mask keeps it apart
            root, mask = member_keys(namespace, mask)
        registration = Registration(secrets.token_hex(12), namespace, root, buffers, opened,
                                    identity=identity, mask=mask, group=membership,
                                    handles=frozenset(bytes(loc.cuda.handle) for loc in locations
                                                      if loc.HasField("cuda")), signals=signals)
        with self._changed:
            try:
                self._check_room(identity.tenant)
                self._check_handles(locations, identity)
            except TiercacheError:
                registration.buffers = None
                for allocation in opened:
                    allocation.close()
                raise
            self._workers[registration.id] = registration
        return registration

    def give_lane(self, registration: Registration, ticket: bytes) -> ctypes.Array:
        """The lane (tiercache/lane.py) handed over under `ticket`, now `registration`'s:
        one per registration."""
        mapping = lane.check(self._tickets.redeem(ticket))
        with self._changed:
            if registration.lane is not None:
                raise FailedPrecondition("this worker has a lane already: one per registration")
            registration.lane = mapping
        return mapping

    def discard_ticket(self, ticket: bytes) -> None:
        """Forget a shared-memory ticket that a failed call named."""
        self._tickets.discard(ticket)

    def _check_handles(self, locations: Sequence[pb.BufferLocation], identity: Identity) -> None:
        """Refuse CUDA allocations that another identity's worker has registered: a
        handle is no secret from every process of the machine, and whoever registers an
        allocation may read and write it through loads and stores."""
        handles = {bytes(loc.cuda.handle) for loc in locations if loc.HasField("cuda")}
        with self._changed:
            for other in (*self._workers.values(), *self._closing.values()):
                if other.identity != identity and handles & other.handles:
                    raise PermissionDenied("a CUDA allocation named here is registered by another "
                                           "identity's worker: register allocations of your own")

    def _check_room(self, tenant: str) -> None:
        with self._changed:
            if len(self._workers) >= self.max_workers:
                raise ResourceExhausted(f"{self.max_workers} workers are registered already: "
                                        "unregister one or raise --max-workers")
            mine = sum(r.identity.tenant == tenant for r in self._workers.values())
            if self.max_per_tenant and mine >= self.max_per_tenant:
                raise ResourceExhausted(f"this tenant has {mine} workers registered, the most "
                                        "one tenant may: unregister one or raise "
                                        "--max-workers-per-tenant")

    @contextmanager
    def use(self, worker_id: str, identity: Identity | None = None) -> Iterator[Registration]:
        """The registration of `worker_id`, in use until the block ends; with `identity`,
        only if that identity registered it."""
        with self._changed:
            registration = self._workers.get(worker_id)
            if registration is None:
                raise NotFound(f"worker {worker_id!r} is not registered (it unregistered, its "
                               "registration stream closed, or the daemon restarted): register again")
            if identity is not None and identity != registration.identity:
                raise PermissionDenied(f"worker {worker_id!r} was registered by another "
                                       "identity: use the credentials it registered with")
            registration.active += 1
        try:
            yield registration
        finally:
            with self._changed:
                registration.active -= 1
                self._changed.notify_all()

    def remove(self, worker_id: str) -> bool:
        """Forget a worker once no call uses it: wait for the copies still touching its
        buffers (asynchronous loads), then close its CUDA allocations; shared-memory
        mappings go with the last reference. The wait is outside the registry's lock:
        those copies may wait for seconds of a worker's GPU work, and every call looks its
        worker up here."""
        with self._changed:
            registration = self._workers.pop(worker_id, None)
            if registration is None:
                return False
            self._closing[worker_id] = registration
            if registration.signals is not None:  # its own stream may never write them
                released = registration.signals.release()
                if released:
                    log.warning("worker %s went with %d calls whose copies still waited for its "
                                "GPU work: released them (its stores among them are dropped)",
                                worker_id, released)
            while registration.active:
                self._changed.wait()
            end_calls = registration.calls  # bound only while in use: none binds now
        if end_calls is not None:
            end_calls()
        try:
            if registration.buffers is not None:
                self._quiesce(registration.buffers)
            registration.buffers = None
            for allocation in registration.opened:
                allocation.close()
        finally:
            with self._changed:
                del self._closing[worker_id]
        registration.gone.set()
        return True

    def remove_all(self) -> None:
        for worker_id in list(self._workers):
            self.remove(worker_id)
