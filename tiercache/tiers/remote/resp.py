"""Redis' side of the wire, as the adapter needs it: commands packed in RESP without
copying large values, replies' errors told apart by what they mean for a cache, and
batches that bound the bytes in flight."""

from __future__ import annotations

from typing import Any, Sequence

from redis import exceptions as rx

from tiercache.tiers.remote.store import Failure

BATCH_BYTES = 64 << 20  # bytes of values in flight per call and round: bounds memory
_INLINE_BYTES = 64 << 10  # values up to this are copied into the request buffer

Command = tuple[Any, ...]


def failure_of(error: BaseException) -> Failure:
    if isinstance(error, rx.MovedError):  # before AskError: MovedError is one
        return Failure.MOVED
    if isinstance(error, rx.AskError):
        return Failure.ASK
    if isinstance(error, rx.OutOfMemoryError):
        return Failure.OOM
    if isinstance(error, (rx.ClusterDownError, rx.TryAgainError, rx.MasterDownError,
                          rx.SlotNotCoveredError)):
        return Failure.CLUSTER_DOWN
    if isinstance(error, rx.TimeoutError):  # before ConnectionError: one of them in redis-py
        return Failure.TIMEOUT
    if isinstance(error, (rx.ConnectionError, OSError)):
        return Failure.CONNECTION
    return Failure.OTHER


def pack(commands: Sequence[Command]) -> list[bytes | memoryview]:
    """Commands in RESP, as few buffers as possible; large values are sent as they are
    (views of the caller's memory), never copied into the request."""
    out: list[bytes | memoryview] = []
    small = bytearray()
    for command in commands:
        small += b"*%d\r\n" % len(command)
        for arg in command:
            data = arg.encode() if isinstance(arg, str) else arg
            size = data.nbytes if isinstance(data, memoryview) else len(data)
            small += b"$%d\r\n" % size
            if size > _INLINE_BYTES:
                out += [bytes(small), data]
                small = bytearray(b"\r\n")
            else:
                small += data
                small += b"\r\n"
    out.append(bytes(small))
    return out


def batches(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[lo, hi) runs of entries holding about BATCH_BYTES each (at least one entry)."""
    runs, lo, held = [], 0, 0
    for i, size in enumerate(sizes):
        if i > lo and held + size > BATCH_BYTES:
            runs.append((lo, i))
            lo, held = i, 0
        held += size
    if lo < len(sizes):
        runs.append((lo, len(sizes)))
    return runs
