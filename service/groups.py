"""Groups of registrations that load together: the tensor-parallel ranks of one engine.

Every member hashes prompts from one root, the group's, so that one process (vLLM's
scheduler, which has no buffers) can hash a prompt once and ask for the whole group. The
daemon keeps each member's entries apart by XORing the keys it is sent with the member's
own namespace's mask (model, layout fingerprint with its TP rank, tenant, extra keys,
hash; tiercache.tenancy): the same bytes-are-reusable rule as for a worker on its
own, so two engines of one model and layout share entries rank by rank, and no two ranks
ever share one.

A Match for a group answers the longest prefix at which every rank has what it needs
(tiercache.joint), and a hit of 0 (GROUP_INCOMPLETE) while any rank is missing: never
registered, unregistered, or gone with its connection. A rank is held by one live
registration; a restarted worker takes its rank back once the old one is gone.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from tiercache.engine import Engine
from tiercache.errors import FailedPrecondition, InvalidArgument, NotFound
from tiercache.hashing import Namespace, PageKey
from tiercache.results import Match, StopReason
from tiercache.v1 import tiercache_pb2 as pb

if TYPE_CHECKING:
    from tiercache_service.workers import Registration, WorkerRegistry

_GROUP_FINGERPRINT = "tiercache/group/v1"  # stands for the layout in the group's root
_MAX_GROUP_SIZE = 4096


@dataclass(frozen=True)
class Membership:
    id: str
    rank: int
    size: int


def membership_of(request: pb.RegisterRequest) -> Membership | None:
    """The group a registration joins, checked; None for a worker on its own."""
    if not request.HasField("group"):
        return None
    group = request.group
    if not group.id:
        raise InvalidArgument("group.id is empty: give the group an id unique to the engine, "
                              "the same on every rank")
    if not 0 < group.size <= _MAX_GROUP_SIZE:
        raise InvalidArgument(f"group.size must lie in [1, {_MAX_GROUP_SIZE}], got {group.size}")
    if group.rank >= group.size:
        raise InvalidArgument(f"group.rank must lie in [0, size={group.size}), got {group.rank}")
    return Membership(group.id, int(group.rank), int(group.size))


def member_keys(namespace: Namespace, own_mask: np.ndarray | None) -> tuple[PageKey, np.ndarray]:
    """(the root every member hashes from, this member's key mask): the mask of its own
    namespace (tiercache.tenancy), or, in a daemon without a secret, its own root."""
    root = replace(namespace, layout_fingerprint=_GROUP_FINGERPRINT).root()
    if own_mask is not None:
        return root, own_mask
    return root, np.frombuffer(namespace.root(), "<u8").copy()


@dataclass
class _Group:
    size: int
    namespace: Namespace  # of the member that founded it, with the group's fingerprint
    page_tokens: int
    root: PageKey
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> worker id
    fingerprints: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupView:
    root: PageKey
    hash_name: str
    model_id: str
    size: int
    page_tokens: int
    live_ranks: tuple[int, ...]


class GroupRegistry:
    def __init__(self, engine: Engine, registry: "WorkerRegistry") -> None:
        self._engine = engine
        self._registry = registry
        self._groups: dict[tuple[str, str], _Group] = {}  # (tenant, group id) -> group
        self._lock = threading.Lock()

    def join(self, registration: "Registration") -> None:
        """Give a registered group member its rank; refuse what does not fit the group."""
        member = registration.group
        assert member is not None
        namespace = registration.namespace
        founding = _Group(member.size, replace(namespace, layout_fingerprint=_GROUP_FINGERPRINT),
                          registration.layout.page_tokens, registration.root)
        with self._lock:
            key = (namespace.tenant, member.id)
            group = self._groups.get(key)
            if group is None or not self._live(group):  # all gone: a restart may change layouts
                group = self._groups[key] = founding
            _check_fits(group, founding, member)
            holder = group.ranks.get(member.rank)
            if holder is not None and holder in self._registry:
                raise FailedPrecondition(f"rank {member.rank} of group {member.id!r} is held by a "
                                         "live worker: give every engine its own group id")
            fingerprint = namespace.layout_fingerprint
            twin = [r for r, f in group.fingerprints.items()
                    if f == fingerprint and r != member.rank and group.ranks[r] in self._registry]
            if twin:
                raise InvalidArgument(f"ranks {twin[0]} and {member.rank} of group {member.id!r} "
                                      "have the same layout, so they would share entries: give "
                                      "each rank its own layout (set Layout.tp_rank)")
            group.ranks[member.rank] = registration.id
            group.fingerprints[member.rank] = fingerprint

    def _live(self, group: _Group) -> list[int]:
        return sorted(r for r, worker in group.ranks.items() if worker in self._registry)

    def _get(self, tenant: str, group_id: str) -> _Group:
        with self._lock:
            group = self._groups.get((tenant, group_id))
        if group is None:
            raise NotFound(f"no rank of group {group_id!r} has registered: start the workers "
                           "first, or check the group id")
        return group

    def describe(self, tenant: str, group_id: str) -> GroupView:
        group = self._get(tenant, group_id)
        with self._lock:
            live = tuple(self._live(group))
        return GroupView(group.root, group.namespace.hash_name, group.namespace.model_id,
                         group.size, group.page_tokens, live)

    def match(self, tenant: str, group_id: str, keys: np.ndarray, checks: np.ndarray | None,
              prefetch: bool) -> Match:
        """The longest prefix every rank can load; 0 while a rank is missing."""
        group = self._get(tenant, group_id)
        with self._lock:
            ranks = [group.ranks.get(r) for r in range(group.size)]
        with ExitStack() as stack:
            members = []
            for worker_id in ranks:
                if worker_id is None or worker_id not in self._registry:
                    return _incomplete(len(keys))
                try:  # stays registered until the match is done
                    members.append(stack.enter_context(self._registry.use(worker_id)))
                except NotFound:  # gone since
                    return _incomplete(len(keys))
            return self._engine.match_group(
                [(m.layout, m.engine_keys(keys)) for m in members], prefetch, checks=checks,
                scope=tenant)


def _check_fits(group: _Group, joining: _Group, member: Membership) -> None:
    where = f"group {member.id!r}"
    if joining.size != group.size:
        raise FailedPrecondition(f"{where} has {group.size} ranks, this worker says {joining.size}: "
                                 "every rank must give the same group.size")
    if joining.namespace != group.namespace:
        raise FailedPrecondition(f"{where} was registered for model {group.namespace.model_id!r} "
                                 f"(hash {group.namespace.hash_name}, extra keys "
                                 f"{list(group.namespace.extra)}): every rank must give the same")
    if joining.page_tokens != group.page_tokens:
        raise FailedPrecondition(f"{where} pages hold {group.page_tokens} tokens, this worker's "
                                 f"{joining.page_tokens}: every rank must use one page size")


def _incomplete(pages: int) -> Match:
    return Match(0, 0, pages, b"", None, StopReason.GROUP_INCOMPLETE)


def describe_to_proto(view: GroupView) -> pb.DescribeGroupResponse:
    return pb.DescribeGroupResponse(namespace_root=view.root, hash=view.hash_name,
                                    size=view.size, live_ranks=view.live_ranks,
                                    model_id=view.model_id, page_tokens=view.page_tokens)

