"""CPU memory of the worker's own layout, in shared memory the daemon can map.

`Client.register` without buffers lays a layout's buffers out itself, one object per
registration. Some workers need more freedom: vLLM keeps every KV cache group in one
backing allocation, and each group is a registration of its own that views the same
bytes. Such a worker allocates the memory once as a region (`Client.shared_region`),
builds its tensors as views into it, and registers the views, as a GPU worker does with
views into one CUDA allocation. A region is a sealed memfd (tiercache.shm) that this
process keeps open: each registration hands it over again and names its views by that
handover's ticket, so every registration maps the same memory. Any client of the process
can register views into a live region; the client that made it closes it.
"""

from __future__ import annotations

import threading
from typing import Mapping

import torch

from tiercache.errors import InvalidArgument
from tiercache.layout import BufferSpec, Layout
from tiercache.shm import SharedBuffers, hand_over
from tiercache.v1 import tiercache_pb2 as pb


class SharedRegion:
    """`nbytes` of zeroed shared memory as a flat uint8 tensor (`tensor`)."""

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise InvalidArgument(f"a shared region needs a positive size, got {nbytes}")
        layout = Layout(1, paged=(BufferSpec("region", 1, (nbytes,), "uint8"),))
        self._shared = SharedBuffers.create(layout)  # its descriptor stays open
        self._offset = self._shared.placements[0].offset
        self.tensor = self._shared.tensors["region"].view(-1)
        with _LOCK:
            _LIVE.append(self)

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Where a contiguous view into this region starts in the shared object, or None
        if it does not lie wholly inside."""
        if tensor.device.type != "cpu" or not self.tensor.numel():
            return None
        start = tensor.data_ptr() - self.tensor.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        if start < 0 or start + nbytes > self.tensor.numel():
            return None
        return self._offset + start

    def ticket(self, path: str) -> bytes:
        """Hand the region to the daemon at `path` (once more); the ticket to register by."""
        assert self._shared.fd is not None, "the region is closed"
        return hand_over(path, self._shared.fd)

    def close(self) -> None:
        """Close the descriptor; the memory goes with the last mapping of it."""
        with _LOCK:
            if self in _LIVE:
                _LIVE.remove(self)
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._shared.close()


_LIVE: list[SharedRegion] = []  # the regions of this process, for region_locations
_LOCK = threading.Lock()


def region_locations(buffers: Mapping[str, torch.Tensor], handover: str
                     ) -> list[pb.BufferLocation]:
    """Where the daemon finds each buffer: CPU tensors that view live regions, each region
    handed over once to the daemon at `handover`."""
    with _LOCK:
        regions = list(_LIVE)
    tickets: dict[int, bytes] = {}
    locations = []
    for name, tensor in buffers.items():
        offsets = [(r, r.offset_of(tensor)) for r in regions if tensor.is_contiguous()]
        found = [(r, at) for r, at in offsets if at is not None]
        if not found:
            raise InvalidArgument(f"CPU buffer {name!r} is not a contiguous view into a shared "
                                  "region: allocate it with Client.shared_region, or register "
                                  "without buffers")
        region, offset = found[0]
        if id(region) not in tickets:
            tickets[id(region)] = region.ticket(handover)
        nbytes = tensor.numel() * tensor.element_size()
        locations.append(pb.BufferLocation(name=name, nbytes=nbytes, shm=pb.SharedMemoryBuffer(
            ticket=tickets[id(region)], offset=offset)))
    return locations
