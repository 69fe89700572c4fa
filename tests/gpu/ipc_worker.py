"""A GPU worker for tests/gpu/test_gpu_ipc.py, in its own process.

    python -m tests.gpu.ipc_worker export ADDRESS TOKEN          # register; print the handles
    python -m tests.gpu.ipc_worker steal ADDRESS TOKEN HANDLES   # register another's handles
    python -m tests.gpu.ipc_worker free ADDRESS TOKEN            # free buffers while registered
    python -m tests.gpu.ipc_worker layouts ADDRESS TOKEN         # a second layout reads nothing

`export` prints "handles HEX,HEX,..." (the IPC handles of its buffers, comma separated)
and waits for a line on stdin. `steal` registers a layout whose buffers name those
handles and prints "refused CODE" or "registered". `free` registers, frees its buffers
(the caching allocator gives the memory back to CUDA), stores and loads anyway, and
prints "calls done" (whatever they answered). `layouts` stores through the device tier
with one layout, then loads the same keys through a worker of a larger layout, prints
"ok" if nothing was loaded and no byte of its rows changed, and then that the first
layout still loads its own bytes exactly.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from tiercache.client import Client
from tiercache.errors import TiercacheError
from tiercache.layout import BufferSpec, Layout
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import layout_to_proto

PAGES = 8


def layout(row_elements: int) -> Layout:
    return Layout(16, paged=(BufferSpec("kv", 4 * PAGES, (row_elements,), "bfloat16"),),
                  slots=(BufferSpec("state", 4, (row_elements,), "float32"),))


def buffers(shape: Layout, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for spec in (*shape.paged, *shape.slots):  # one allocation each
        raw = torch.randint(0, 256, (spec.rows, spec.row_bytes), dtype=torch.uint8, device="cuda",
                            generator=gen)
        out[spec.name] = raw.view(getattr(torch, spec.dtype)).view(spec.shape)
    return out


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(tensor.shape[0], -1).view(torch.uint8)


def tokens() -> list[int]:
    return np.random.default_rng(7).integers(0, 150_000, PAGES * 16).tolist()


def export(address: str, token: str) -> None:
    from tiercache import cuda_ipc
    shape = layout(4096)
    tensors = buffers(shape, 1)
    worker = Client(address, token=token).register("ipc-test", shape, buffers=tensors)
    handles = [cuda_ipc.export(t).handle.hex() for t in tensors.values()]
    print("handles " + ",".join(handles), flush=True)
    sys.stdin.readline()
    worker.close()


def steal(address: str, token: str, handles: str) -> None:
    from tiercache import cuda_ipc
    shape = layout(4096)
    uuid = cuda_ipc.device_uuid(0)
    locations = [pb.BufferLocation(name=spec.name, nbytes=spec.rows * spec.row_bytes,
                                   cuda=pb.CudaIpcBuffer(handle=bytes.fromhex(h), offset=0,
                                                         device_uuid=uuid))
                 for spec, h in zip((*shape.paged, *shape.slots), handles.split(","))]
    client = Client(address, token=token)
    try:
        next(client._stub.Register(pb.RegisterRequest(model_id="ipc-test", layout=layout_to_proto(shape),
                                                      buffers=locations),
                                   metadata=(("authorization", f"Bearer {token}"),)))
        print("registered", flush=True)
    except Exception as error:  # noqa: BLE001 - the code is what the test reads
        print(f"refused {error.code().name}", flush=True)


def free(address: str, token: str) -> None:
    shape = layout(4096)
    tensors = buffers(shape, 2)
    worker = Client(address, token=token).register("ipc-test", shape, buffers=tensors)
    tensors.clear()
    torch.cuda.empty_cache()  # the allocations go back to CUDA while the daemon holds them
    for call in (lambda: worker.store(tokens(), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0}),
                 lambda: worker.load(tokens(), kv_rows=range(PAGES, 2 * PAGES), slot=1)):
        try:
            call()
        except TiercacheError as error:
            print(f"answered {error}", flush=True)
    torch.cuda.synchronize()
    print("calls done", flush=True)
    worker.close()


def layouts(address: str, token: str) -> None:
    small, large = layout(2048), layout(8192)
    mine = buffers(small, 3)
    source = {name: bits(t).clone() for name, t in mine.items()}
    client = Client(address, token=token)
    first = client.register("ipc-test", small, buffers=mine)
    first.store(tokens(), kv_rows=range(PAGES), checkpoints={PAGES * 16: 0})
    other = buffers(large, 4)
    second = client.register("ipc-test", large, buffers=other)
    before = {name: bits(t).clone() for name, t in other.items()}
    result = second.load(keys=first.keys(tokens()), kv_rows=range(PAGES), slot=1)
    torch.cuda.synchronize()
    untouched = all(torch.equal(bits(other[n]), before[n]) for n in other)
    for t in mine.values():
        bits(t).fill_(0xA5)
    again = first.load(tokens(), kv_rows=range(PAGES, 2 * PAGES), slot=1)
    torch.cuda.synchronize()
    exact = (again.match.pages == PAGES
             and torch.equal(bits(mine["kv"])[PAGES:2 * PAGES], source["kv"][:PAGES])
             and torch.equal(bits(mine["state"])[1], source["state"][0]))
    tiers = {t.name for t in result.match.page_tiers} | {t.name for t in again.match.page_tiers}
    print(f"second loaded {result.match.pages} untouched {untouched} first exact {exact} tiers {tiers}")
    print("ok" if result.match.pages == 0 and untouched and exact else "bad", flush=True)
    first.close()
    second.close()


if __name__ == "__main__":
    {"export": export, "steal": steal, "free": free, "layouts": layouts}[sys.argv[1]](*sys.argv[2:])
