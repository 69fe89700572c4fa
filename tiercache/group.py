"""Groups of registrations, from the worker's side (the daemon's side is service/groups.py).

The tensor-parallel ranks of one engine register as ranks of one group
(`Client.register(..., group=GroupMember(id, rank, size))`); all of them then hash
prompts from the group's root, and a Match from any rank answers the longest prefix
that every rank can load (0 while a rank is missing). A process with no buffers of its
own, such as vLLM's scheduler, asks for the group by id:

    group = client.group("engine-7f3a", timeout=0.05)   # root, page size, live ranks
    hit = group.match(tokens)                           # one call for every rank
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiercache.errors import InvalidArgument
from tiercache.hashing import Chain, Keys, PageKey, check_prompt, key_array, page_chain, page_keys
from tiercache.results import Match
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc
from tiercache.wire import answered, match_from_proto


@dataclass(frozen=True)
class GroupMember:
    """This registration's place in a group: rank `rank` of `size`, all under `id`."""

    id: str
    rank: int
    size: int

    def __post_init__(self) -> None:
        if not self.id:
            raise InvalidArgument("a group needs an id, the same on every rank")
        if not 0 <= self.rank < self.size:
            raise InvalidArgument(f"group rank must lie in [0, size={self.size}), got {self.rank}")

    def to_proto(self) -> pb.Group:
        return pb.Group(id=self.id, rank=self.rank, size=self.size)


class Group:
    """A group as the daemon describes it now, and matches for all its ranks at once."""

    def __init__(self, stub: pb_grpc.TiercacheStub, group_id: str, timeout: float,
                 metadata: tuple[tuple[str, str], ...]) -> None:
        self.id = group_id
        self._stub = stub
        self._call: dict[str, Any] = {"timeout": timeout, "metadata": metadata}
        reply = answered(lambda: stub.DescribeGroup(pb.DescribeGroupRequest(group=group_id),
                                                    **self._call))
        self.root = PageKey(reply.namespace_root)
        self.hash_name = reply.hash
        self.model_id = reply.model_id
        self.size = reply.size
        self.page_tokens = reply.page_tokens
        self.live_ranks = tuple(reply.live_ranks)

    @property
    def complete(self) -> bool:
        """Whether every rank was registered when the daemon described the group."""
        return len(self.live_ranks) == self.size

    def keys(self, tokens: Any) -> list[PageKey]:
        """The page keys of a prompt from the group's root (full pages only)."""
        return page_keys(tokens, self.root, self.page_tokens, self.hash_name)

    def chain(self, tokens: Any) -> Chain:
        """The page keys and checks of a prompt from the group's root."""
        return page_chain(tokens, self.root, self.page_tokens, self.hash_name)

    def match(self, tokens: Any = None, *, keys: Keys | Chain | None = None,
              prefetch: bool = False) -> Match:
        """The longest prefix every rank can load now (GROUP_INCOMPLETE, 0 pages, while a
        rank is missing). Given tokens or a Chain, each page's check goes along (a key
        collision misses)."""
        check_prompt(tokens, keys)
        if tokens is not None:
            keys = self.chain(tokens)
        if isinstance(keys, Chain):
            packed, checks = key_array(keys.keys).tobytes(), keys.checks.astype("<u8").tobytes()
        else:
            packed, checks = key_array(keys).tobytes(), b""
        request = pb.MatchRequest(group=self.id, keys=packed, checks=checks, prefetch=prefetch)
        return match_from_proto(answered(lambda: self._stub.Match(request, **self._call)).match)
