"""A worker's CUDA buffers, shared with the daemon through CUDA IPC handles.

The worker exports, per buffer, the IPC handle of the allocation holding it, the buffer's
offset in that allocation, its size and the GPU's UUID (device indices differ between
processes with different CUDA_VISIBLE_DEVICES; UUIDs do not). The daemon opens each
allocation once, checks that the buffer fits in it, and closes it when the worker goes.

An IPC handle exposes the whole allocation: with PyTorch's caching allocator that can be
a segment shared with other tensors, which the daemon could then address and which
cannot be freed while the daemon holds it. Give exported buffers allocations of their
own (`torch.cuda.caching_allocator_alloc` or one big tensor per buffer group, allocated
before anything else).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from tiercache.errors import InvalidArgument, NotFound


def _runtime() -> tuple[Any, Any]:
    try:
        from cuda.bindings import driver, runtime
    except ImportError as error:
        raise InvalidArgument("CUDA buffers need the cuda-bindings package: pip install "
                              "cuda-bindings (it ships with CUDA builds of PyTorch images)") from error
    return driver, runtime


def _check(result: tuple, what: str) -> tuple:
    status, *values = result
    if int(status) != 0:
        raise InvalidArgument(f"{what} failed: {status!r}")
    return tuple(values)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


@dataclass(frozen=True)
class Exported:
    handle: bytes  # cudaIpcMemHandle_t, 64 bytes
    offset: int  # of the buffer inside the allocation
    nbytes: int
    device_uuid: str


def export(tensor: torch.Tensor) -> Exported:
    """The IPC description of a contiguous CUDA tensor."""
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise InvalidArgument("only contiguous CUDA tensors can be shared by CUDA IPC")
    driver, runtime = _runtime()
    with torch.cuda.device(tensor.device):
        (handle,) = _check(runtime.cudaIpcGetMemHandle(tensor.data_ptr()), "cudaIpcGetMemHandle")
        base, _ = _check(driver.cuMemGetAddressRange(tensor.data_ptr()), "cuMemGetAddressRange")
    return Exported(bytes(handle.reserved), tensor.data_ptr() - int(base),
                    tensor.numel() * tensor.element_size(), device_uuid(tensor.device.index))


class _DeviceArray:
    """Lets torch.as_tensor view raw device memory without a copy."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 3}


class Opened:
    """One opened allocation; views of it are valid until close().

    Several registrations may name one allocation (vLLM keeps every KV cache group in
    one): each allocation is opened once per process and device, and closed when the last
    registration that opened it closes it, whatever the driver makes of repeated opens."""

    def __init__(self, handle: bytes, device: int) -> None:
        self.handle = bytes(handle)
        self._key = (self.handle, device)
        with _OPEN_LOCK:
            entry = _OPEN.get(self._key)
            if entry is None:
                entry = _OPEN[self._key] = [*_open(handle, device), 0]
            entry[2] += 1
        self.address, self.size, self.device = entry[0], entry[1], device
        self._closed = False

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        if offset < 0 or offset + nbytes > self.size:
            raise InvalidArgument(f"a buffer of {nbytes} bytes at offset {offset} runs past the end "
                                  f"of its CUDA allocation ({self.size} bytes)")
        return torch.as_tensor(_DeviceArray(self.address + offset, nbytes),
                               device=torch.device("cuda", self.device))

    def close(self) -> None:
        with _OPEN_LOCK:
            if self._closed:
                return
            self._closed = True
            entry = _OPEN[self._key]
            entry[2] -= 1
            if entry[2]:
                return
            del _OPEN[self._key]
        _, runtime = _runtime()
        with torch.cuda.device(self.device):
            _check(runtime.cudaIpcCloseMemHandle(self.address), "cudaIpcCloseMemHandle")


def _open(handle: bytes, device: int) -> tuple[int, int]:
    """(address, size) of the allocation behind an IPC handle, opened in this process."""
    driver, runtime = _runtime()
    ipc = runtime.cudaIpcMemHandle_t()
    ipc.reserved = handle
    with torch.cuda.device(device):
        (address,) = _check(runtime.cudaIpcOpenMemHandle(
            ipc, runtime.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle")
        _, size = _check(driver.cuMemGetAddressRange(address), "cuMemGetAddressRange")
    return int(address), int(size)


_OPEN: dict[tuple[bytes, int], list[int]] = {}  # (handle, device) -> [address, size, opens]
_OPEN_LOCK = threading.Lock()


def local_device(uuid: str) -> int:
    """This process's index of the GPU with `uuid`."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise NotFound(f"GPU {uuid} is not visible to the daemon: give it the worker's GPUs "
                   "(CUDA_VISIBLE_DEVICES, or the pod's GPU resources)")


class OpenedEvents:
    """Interprocess CUDA events of another process, each opened once by its handle: the
    other side records the same few again, and a wait counts each one's latest record.
    At most `limit` stay open, the oldest closed first, whatever handles come."""

    def __init__(self, limit: int = 16) -> None:
        self._limit = limit
        self._events: dict[bytes, torch.cuda.Event] = {}
        self._lock = threading.Lock()

    def open(self, device: torch.device, handle: bytes) -> torch.cuda.Event:
        """The event named by `handle` (RuntimeError from CUDA if it names none)."""
        with self._lock:
            event = self._events.get(handle)
        if event is None:
            event = torch.cuda.Event.from_ipc_handle(device, handle)
            with self._lock:
                while len(self._events) >= self._limit:
                    self._events.pop(next(iter(self._events)))
                self._events[handle] = event
        return event
