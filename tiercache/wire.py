"""Conversions between the library's types and the v1 wire messages, shared by the
client and the daemon so that both sides read the contract the same way."""

from __future__ import annotations

from typing import Callable, TypeVar

import grpc

from tiercache.errors import (DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound,
                              PermissionDenied, ResourceExhausted, TiercacheError, Unauthenticated,
                              Unavailable)
from tiercache.layout import BufferSpec, Layout
from tiercache.results import LoadResult, Match, StopReason, StoreResult, Tier, TierStats
from tiercache.v1 import tiercache_pb2 as pb

# Domain errors and their gRPC status codes: the daemon answers with these, the client
# raises the same classes back, so embedded and remote callers see one set of errors.
STATUS_CODES: dict[type[TiercacheError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}
_ERRORS = {code: kind for kind, code in STATUS_CODES.items()}
T = TypeVar("T")


def status_of(error: TiercacheError) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in STATUS_CODES:
            return STATUS_CODES[kind]
    return grpc.StatusCode.INTERNAL


_DETAILS_CHARS = 400  # what a status message says at most: it may quote client input


def details_of(error: TiercacheError) -> str:
    """The error's message for a status, cut short: a message quoting a megabyte of the
    client's input would fail as a too-large trailer instead of saying what was wrong."""
    text = str(error)
    return text if len(text) <= _DETAILS_CHARS else text[:_DETAILS_CHARS] + "... (cut short)"


def error_of(error: grpc.RpcError) -> TiercacheError:
    """The domain error a failed call stands for, with the daemon's message."""
    return error_from(error.code(), error.details())  # type: ignore[attr-defined]


def answered(call: Callable[[], T]) -> T:
    """What a call answered, or, if it failed, the domain error its failure stands for."""
    try:
        return call()
    except grpc.RpcError as error:
        raise error_of(error) from None


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_from(number: int) -> grpc.StatusCode:
    """The status code of its number, as CallReply.code gives it (UNKNOWN for none)."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


def error_from(code: grpc.StatusCode | int, details: str) -> TiercacheError:
    """The domain error of a status code (or its number, as CallReply.code gives it)."""
    status = code if isinstance(code, grpc.StatusCode) else status_from(code)
    return _ERRORS.get(status, TiercacheError)(f"{details} ({status.name})")


_STOPS = {StopReason.END_OF_PROMPT: pb.END_OF_PROMPT, StopReason.MISSING_PAGE: pb.MISSING_PAGE,
          StopReason.NO_CHECKPOINT: pb.NO_CHECKPOINT,
          StopReason.GROUP_INCOMPLETE: pb.GROUP_INCOMPLETE}
_STOPS_BACK = {v: k for k, v in _STOPS.items()}


def layout_to_proto(layout: Layout) -> pb.Layout:
    def spec(b: BufferSpec) -> pb.BufferSpec:
        return pb.BufferSpec(name=b.name, rows=b.rows, row_shape=b.row_shape, dtype=b.dtype)
    return pb.Layout(page_tokens=layout.page_tokens, paged=[spec(b) for b in layout.paged],
                     slots=[spec(b) for b in layout.slots], tp_rank=layout.tp_rank,
                     tp_size=layout.tp_size)


def layout_from_proto(message: pb.Layout) -> Layout:
    """A validated Layout; a bad field raises LayoutError naming it."""
    def spec(b: pb.BufferSpec) -> BufferSpec:
        return BufferSpec(b.name, int(b.rows), tuple(int(d) for d in b.row_shape), b.dtype)
    return Layout(int(message.page_tokens), tuple(spec(b) for b in message.paged),
                  tuple(spec(b) for b in message.slots), int(message.tp_rank),
                  int(message.tp_size) or 1)


def tier_from_proto(value: int, remote: bool = False) -> Tier | None:
    """A local tier (an Evict names one), or with `remote`, the remote one too (a Match
    reports it)."""
    if value == pb.TIER_UNSPECIFIED:
        return None
    if value not in (Tier.DEVICE, Tier.HOST, Tier.DISK, *((Tier.REMOTE,) if remote else ())):
        raise InvalidArgument(f"tier {value} is not one of DEVICE (1), HOST (2), DISK (4)")
    return Tier(value)


def match_to_proto(match: Match) -> pb.MatchResult:
    return pb.MatchResult(pages=match.pages, tokens=match.tokens, prompt_pages=match.prompt_pages,
                          page_tiers=match.tier_codes,
                          checkpoint_tier=int(match.checkpoint_tier or pb.TIER_UNSPECIFIED),
                          stop=_STOPS[match.stop], kv_pages=match.kv_pages)


def match_from_proto(message: pb.MatchResult) -> Match:
    return Match(pages=message.pages, tokens=message.tokens, prompt_pages=message.prompt_pages,
                 tier_codes=bytes(message.page_tiers),
                 checkpoint_tier=tier_from_proto(message.checkpoint_tier, remote=True),
                 stop=_STOPS_BACK[message.stop], kv_pages=message.kv_pages)


def load_to_proto(result: LoadResult, hand_back: bool = True) -> pb.LoadResponse:
    """`hand_back`: the reply names the load's done event (not where the worker gave its own)."""
    event = result.done.ipc_handle() if hand_back and result.done is not None else b""
    return pb.LoadResponse(match=match_to_proto(result.match), damaged=result.damaged,
                           bytes_from=[pb.TierBytes(tier=int(t), bytes=n)
                                       for t, n in sorted(result.bytes_from.items())],
                           done_event=event)


def load_from_proto(message: pb.LoadResponse) -> LoadResult:
    return LoadResult(match_from_proto(message.match),
                      {Tier(b.tier): b.bytes for b in message.bytes_from}, message.damaged)


def store_to_proto(result: StoreResult) -> pb.StoreResponse:
    return pb.StoreResponse(stored=result.stored, present=result.present, skipped=result.skipped,
                            checkpoints=result.checkpoints)


def store_from_proto(message: pb.StoreResponse) -> StoreResult:
    return StoreResult(message.stored, message.present, message.skipped, tuple(message.checkpoints))


def tier_stats_to_proto(stats: TierStats) -> pb.TierStats:
    return pb.TierStats(tier=int(stats.tier), entries=stats.entries, used_bytes=stats.used_bytes,
                        budget_bytes=stats.budget_bytes)


def tier_stats_from_proto(message: pb.TierStats) -> TierStats:
    return TierStats(Tier(message.tier), message.entries, message.used_bytes, message.budget_bytes)
