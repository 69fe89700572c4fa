"""Fuzz every RPC with structure-aware random messages (hypothesis), then with raw bytes.

Structured: the servicer runs in this process behind the daemon's error interceptor, on
a real engine (host and disk tiers), a registry with a secret and a tenants config, and
the real buffer handover on a Unix socket. Two tenants each register workers of two
layouts (four namespaces, each worker with shared memory of its own). Hypothesis builds
each RPC's message field by field: worker ids that exist, belong to another tenant or do
not; keys of the caller's prompts, of *other namespaces'* prompts, with a key repeated,
or random; checks that fit or not; row ids, slots and checkpoints in and out of range;
layouts with odd shapes, sizes and dtypes; tickets fresh, spent or made up, and CUDA
handles; credentials valid, another tenant's, malformed or absent; deadlines past. A
Match, Load or Store goes as a call of its own, as the message of a Calls stream, or
through the lane (tiercache/lane.py) of one of the four workers, its own or another's.

Three oracles watch every input:
- statuses: a call must end with a reply or a deliberate status, never an exception
  nobody meant (INTERNAL, UNKNOWN);
- isolation: before a store the fuzzer writes into the rows it names bytes that are a
  function of the storing namespace and each key (and remembers a hash of each entry
  offered). After every load, each loaded page and checkpoint must be one that *this*
  namespace offered under *that* key, and every other row and slot of the caller must be
  unchanged; a load that fails changes nothing. A byte of any other namespace, layout or
  key is a foreign byte: the run fails;
- the books: tiercache.invariants after every call (keys map to their own rows, counts,
  slots, pins).

Raw: random bytes as the request of each method, to a daemon process: the daemon must
answer each call (grpc's INTERNAL for what it cannot parse is fine) and keep serving.

    python -m benchmarks.fuzz_rpc [--examples 100000] [--raw 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
import numpy as np
import hypothesis
import torch
import xxhash
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from benchmarks.common import print_summary, print_table
from drills.context import Aborted, Context
from tiercache_service.auth import Authenticator, Tenant, _digest
from tiercache_service.errors import ErrorInterceptor
from tiercache_service.handover import Handover
from tiercache_service.servicer import TiercacheServicer
from tiercache_service.workers import WorkerRegistry
from drills import keyed, prompts
from tiercache import invariants
from tiercache.engine import Engine, EngineConfig
from tiercache.errors import FailedPrecondition, TiercacheError
from tiercache.hashing import page_chain
from tiercache.layout import BufferSpec, Layout
from tiercache import lane, shm
from tiercache.shm import SharedBuffers
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import layout_to_proto, status_from, status_of

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAUTHENTICATED,
           grpc.StatusCode.PERMISSION_DENIED}
TOKENS = {"acme": "acme-token", "beta": "beta-token"}
# a second layout per tenant: pages four times as large, a checkpoint of another size
LARGE = Layout(prompts.PAGE, paged=(BufferSpec("kv0", 4 * prompts.PAGES, (prompts.PAGE, 2, 32),
                                               "bfloat16"),),
               slots=(BufferSpec("ssm", 4, (16, 16), "float32"),))
LAYOUTS = {"small": prompts.LAYOUT, "large": LARGE}
NAMESPACES = [(tenant, name) for tenant in TOKENS for name in LAYOUTS]
PROMPTS = 6  # prompts per namespace, sharing prefixes by family
MAX_PAGES = 256
FRESH = b"fresh-ticket"  # replaced by the ticket of a real handover when the call is made


def token_context(tenant: str) -> Context:
    return Context((("authorization", f"Bearer {TOKENS[tenant]}"),), "unix:", [], None)


@dataclass
class Worker:
    """One registered worker of the fuzzer's: its namespace, buffers and prompts' keys."""

    tenant: str
    layout: Layout
    id: str
    shared: SharedBuffers
    keys: list[list[bytes]]  # per prompt, as this worker sends them
    checks: list[bytes]
    lane: lane.Lane | None = None  # its lane of calls, opened once registered

    @property
    def rows(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        rows = keyed.byte_rows(self.shared.tensors)  # layout order: paged, then slots
        return rows[:len(self.layout.paged)], rows[len(self.layout.paged):]


@dataclass
class World:
    servicer: TiercacheServicer
    engine: Engine
    handover: Handover
    workers: dict[tuple[str, str], Worker]  # by namespace: (tenant, layout name)
    handlers: dict = field(default_factory=dict)
    offered: dict = field(default_factory=lambda: collections.defaultdict(set))

    def owner(self, worker_id: str) -> Worker | None:
        return next((w for w in self.workers.values() if w.id == worker_id), None)


def guarded(servicer: TiercacheServicer, method: str, kind: str = "unary_unary"):
    """The servicer's method as grpc would call it through the error interceptor; `kind`:
    unary_unary, unary_stream or stream_stream."""
    handler = getattr(grpc, f"{kind}_rpc_method_handler")(getattr(servicer, method))

    class Details:
        pass
    details = Details()
    details.method = f"/tiercache.v1.Tiercache/{method}"
    return getattr(ErrorInterceptor().intercept_service(lambda _: handler, details), kind)


def locations(placements: list[shm.Placement], ticket: bytes) -> list[pb.BufferLocation]:
    return [pb.BufferLocation(name=p.spec.name, nbytes=p.nbytes,
                              shm=pb.SharedMemoryBuffer(ticket=ticket, offset=p.offset))
            for p in placements]


def build_world(folder: Path) -> World:
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 18, pin=False),
                                      disk=DiskConfig(str(folder / "lmdb"), map_size=1 << 22, sync=False)))
    tenants = {name: Tenant(name, (_digest(token),), (f"{name}-worker",))
               for name, token in TOKENS.items()}
    handover = Handover(str(folder / "handover.sock")).start()
    registry = WorkerRegistry(16, engine.quiesce, secret=b"s" * 32, max_per_tenant=6,
                              tickets=handover)
    servicer = TiercacheServicer(engine, registry, MAX_PAGES, Authenticator(tenants))
    world = World(servicer, engine, handover, {})
    for method in ("Match", "Load", "Store", "Evict", "Stats", "Unregister", "Settle", "OpenLane"):
        world.handlers[method] = guarded(servicer, method)
    world.handlers["Register"] = guarded(servicer, "Register", "unary_stream")
    world.handlers["Calls"] = guarded(servicer, "Calls", "stream_stream")
    for tenant, name in NAMESPACES:
        layout = LAYOUTS[name]
        shared = SharedBuffers.create(layout)
        reply = next(servicer.Register(pb.RegisterRequest(
            model_id=prompts.MODEL, layout=layout_to_proto(layout),
            buffers=locations(shared.placements, shared.hand_over(handover.path))),
            token_context(tenant)))
        chains = [page_chain(prompts.tokens(p), reply.namespace_root, prompts.PAGE)
                  for p in range(PROMPTS)]
        worker = Worker(tenant, layout, reply.worker_id, shared, [c.keys for c in chains],
                        [c.checks.astype("<u8").tobytes() for c in chains],
                        lane.Lane(lambda id=reply.worker_id: id in registry))
        servicer.OpenLane(pb.OpenLaneRequest(worker_id=worker.id, lane=pb.SharedMemoryBuffer(
            ticket=worker.lane.hand_over(handover.path))), token_context(tenant))
        world.workers[tenant, name] = worker
    return world


def digest(entry: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(entry.tobytes())


def content(worker: Worker, key: bytes, kind: bytes, nbytes: int) -> np.ndarray:
    """What `worker` writes for an entry: a function of its namespace and the key."""
    return keyed.content(f"{worker.tenant}/{worker.layout.fingerprint}".encode() + key, kind, nbytes)


def prepare_store(world: World, worker: Worker, request: pb.StoreRequest, tenant: str) -> None:
    """Write what an honest worker would hold into the rows a store names, and note each
    entry offered under the storing namespace (if the caller may store for that worker)."""
    paged, slots = worker.rows
    keys = [request.keys[i:i + 16] for i in range(0, len(request.keys) // 16 * 16, 16)]
    pages = [(key, row) for key, row in zip(keys, request.kv_rows) if row < worker.layout.page_rows]
    offers = [(c.pages, c.slot) for c in request.checkpoints
              if 0 < c.pages <= len(keys) and c.slot < worker.layout.slot_rows]
    for key, row in pages:
        keyed.write_entry(paged, row, content(worker, key, keyed.PAGE, keyed.entry_bytes(paged)))
    for n, slot in offers:
        keyed.write_entry(slots, slot, content(worker, keys[n - 1], keyed.CHECKPOINT,
                                               keyed.entry_bytes(slots)))
    if tenant != worker.tenant:
        return
    ns = (worker.tenant, worker.layout.fingerprint)
    for key, row in pages:
        world.offered[ns, key, keyed.PAGE].add(digest(keyed.read_entry(paged, row)))
    for n, slot in offers:
        world.offered[ns, keys[n - 1], keyed.CHECKPOINT].add(digest(keyed.read_entry(slots, slot)))


def foreign_bytes(world: World, worker: Worker, request: pb.LoadRequest, reply,
                  before: list[torch.Tensor]) -> list[str]:
    """What a load put into the caller's rows that its namespace never stored there."""
    paged, slots = worker.rows
    pages = 0 if isinstance(reply, grpc.StatusCode) else reply.match.pages
    keys = [request.keys[i:i + 16] for i in range(0, 16 * pages, 16)]
    ns, wrong = (worker.tenant, worker.layout.fingerprint), []
    loaded = {int(r) for r in request.kv_rows[:pages]}
    for key, row in zip(keys, request.kv_rows):
        if digest(keyed.read_entry(paged, row)) not in world.offered[ns, key, keyed.PAGE]:
            wrong.append(f"page row {row}")
    slot = int(request.slot) if pages and slots else None
    if slot is not None and digest(keyed.read_entry(slots, slot)) not in world.offered[
            ns, keys[-1], keyed.CHECKPOINT]:
        wrong.append(f"slot {slot}")
    after = [t.clone() for t in paged + slots]
    for n, (old, new) in enumerate(zip(before, after)):
        is_paged = n < len(paged)
        for row in torch.nonzero((old != new).any(dim=1)).flatten().tolist():
            if (row not in loaded) if is_paged else (row != slot):
                wrong.append(f"{'page row' if is_paged else 'slot'} {row} changed, not loaded")
    return wrong


def call(world: World, method: str, request, context: Context, way: tuple | None = None):
    """One call as gRPC would make it; returns the reply or the abort's code. With a `way`,
    a Match, Load or Store goes as the message of a Calls stream (("stream", timeout))
    or through a worker's lane (("lane", timeout, its namespace)) instead."""
    if way is not None and way[0] == "lane":
        return in_lane(world.workers[way[2]].lane, method, request, way[1])
    if way is not None:
        return streamed(world, method, request, context, way[1])
    handler = world.handlers.get(method) or getattr(world.servicer, method)
    try:
        if method == "Register":
            stream = handler(request, context)
            try:
                return next(stream)
            finally:
                context.end()  # the stream ends: the registration goes
                stream.close()
        return handler(request, context)
    except Aborted:
        return context.code


STREAMED = ("Match", "Load", "Store")  # the calls a Calls stream carries


def streamed(world: World, method: str, request, context: Context, timeout: float):
    """The call as the one message of a Calls stream: its reply, or its code (the reply's,
    or the stream's abort)."""
    kind = method.lower()
    try:
        replies = world.handlers["Calls"](iter([pb.CallRequest(timeout_seconds=timeout,
                                                               **{kind: request})]), context)
        reply = next(replies)
        replies.close()
    except Aborted:
        return context.code
    if reply.code:
        return status_from(reply.code)
    return getattr(reply, kind)


def in_lane(way: lane.Lane, method: str, request, timeout: float):
    """The call as a message in a worker's lane: its reply, or its reply's code."""
    reply = way.start(method.lower(), request, timeout)
    if reply is None:  # too large for a lane
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    try:
        return reply()
    except TiercacheError as error:
        return status_of(error)


def caller_tenant(context: Context) -> str | None:
    tokens = {f"Bearer {t}": name for name, t in TOKENS.items()}
    found = [tokens.get(v) for k, v in context.metadata if k == "authorization"]
    return found[0] if found else None


def fresh_ticket(hand_over: Callable[[], bytes]) -> bytes:
    """The ticket of a real handover; past the daemon's bound on handovers waiting to be
    named (refused calls leave theirs to expire), a ticket that is gone."""
    try:
        return hand_over()
    except FailedPrecondition:
        return b"\x00" * 16


def fuzzed_call(world: World, method: str, request, context: Context,
                way: tuple | None = None) -> tuple[object, list[str]]:
    """The call, with the isolation oracle around it: (reply or code, foreign bytes)."""
    worker = world.owner(getattr(request, "worker_id", ""))
    if method == "Register" and request.buffers and request.buffers[0].shm.ticket == FRESH:
        ticket = fresh_ticket(lambda: SharedBuffers.create(prompts.LAYOUT).hand_over(world.handover.path))
        for location in request.buffers:
            if location.HasField("shm"):
                location.shm.ticket = ticket
    if method == "OpenLane" and request.lane.ticket == FRESH:  # a real lane, or another memfd
        fd, _ = shm.sealed(lane.LANE_BYTES if request.lane.offset % 2 else 4096, "fuzzed-lane")
        try:
            request.lane.ticket = fresh_ticket(lambda: shm.hand_over(world.handover.path, fd))
        finally:
            os.close(fd)
    if method == "Store" and worker is not None:  # a lane's calls are its owner's
        tenant = world.workers[way[2]].tenant if way and way[0] == "lane" else caller_tenant(context)
        prepare_store(world, worker, request, tenant)
    before = [t.clone() for t in sum(worker.rows, [])] if worker is not None and method == "Load" else None
    reply = call(world, method, request, context, way)
    wrong = foreign_bytes(world, worker, request, reply, before) if before is not None else []
    return reply, wrong


# -- strategies -----------------------------------------------------------------------------
# Each field is mostly something a real worker would send, so that calls get past the
# first check and into the engine, and otherwise anything at all.
def mostly(usual, odd, share: float = 0.75):
    return st.floats(0, 1).flatmap(lambda x: usual if x < share else odd)


def u32(): return mostly(st.integers(0, 24), st.integers(0, 2**32 - 1))
def u64(): return mostly(st.integers(0, 1 << 16), st.integers(0, 2**64 - 1))


def contexts(world: World, tenant: str):
    own = (("authorization", f"Bearer {TOKENS[tenant]}"),)
    metadata = mostly(st.just(own), st.one_of(
        st.just(()),
        st.sampled_from([(("authorization", f"Bearer {t}"),) for t in TOKENS.values()]),
        st.builds(lambda v: (("authorization", v),), st.text(max_size=40)),
        st.lists(st.tuples(st.sampled_from(["authorization", "x-other"]),
                           st.text(max_size=20)), max_size=3).map(tuple)), 0.85)
    names = mostly(st.just([]), st.lists(st.sampled_from(
        [b"acme-worker", b"beta-worker", b"stranger", b"\xff\xfe"]), min_size=1, max_size=2))
    remaining = mostly(st.none(), st.one_of(st.just(0.0), st.floats(-5, 30)), 0.9)
    return st.builds(Context, metadata, st.sampled_from(["unix:", "ipv4:10.0.0.1:5000"]), names,
                     remaining)


def keys_and_checks(world: World, worker: Worker):
    """Keys of the caller's own prompts mostly; else another namespace's, with a key
    repeated, or random bytes. Checks to match, or none, or wrong."""
    def prompt(source: Worker, p: int, n: int, repeat: int | None):
        keys, checks = source.keys[p][:n], source.checks[p][:8 * n]
        if repeat is not None:
            keys, checks = keys + [keys[repeat % n]], checks + checks[8 * (repeat % n):8 * (repeat % n) + 8]
        return b"".join(keys), checks
    sources = mostly(st.just(worker), st.sampled_from(list(world.workers.values())), 0.6)
    chosen = st.builds(prompt, sources, st.integers(0, PROMPTS - 1), st.integers(1, prompts.PAGES),
                       mostly(st.none(), st.integers(0, prompts.PAGES), 0.9))
    odd = st.tuples(st.one_of(st.binary(max_size=40 * 16).map(lambda b: b[:len(b) // 16 * 16]),
                              st.binary(max_size=300),
                              st.integers(MAX_PAGES - 1, MAX_PAGES + 2).map(lambda n: b"\x07" * 16 * n)),
                    st.just(b""))
    pair = mostly(chosen, odd, 0.85)
    return pair.flatmap(lambda kc: st.tuples(st.just(kc[0]), st.sampled_from(
        [kc[1]] * 4 + [b"", b"\x01" * len(kc[1]), b"\x00" * 12])))


def layouts():
    specs = st.builds(pb.BufferSpec, name=st.one_of(st.sampled_from(["kv0", "kv1", "ssm"]),
                                                     st.text(max_size=8)),
                      rows=u64(), row_shape=st.lists(u64(), max_size=4),
                      dtype=st.sampled_from(["bfloat16", "float32", "uint8", "int4", "", "bool"]))
    return mostly(st.just(layout_to_proto(prompts.LAYOUT)), st.builds(
        pb.Layout, page_tokens=u32(), paged=st.lists(specs, max_size=4),
        slots=st.lists(specs, max_size=3), tp_rank=u32(), tp_size=u32()), 0.5)


def buffer_locations():
    placements = shm.plan(prompts.LAYOUT)[0]
    tickets = st.sampled_from([FRESH, FRESH, b"\0" * 16, b"", b"x" * 40])
    usual = tickets.map(lambda t: locations(placements, t))
    memory = st.builds(pb.SharedMemoryBuffer, ticket=tickets, offset=u64())
    cuda = st.builds(pb.CudaIpcBuffer, handle=st.binary(max_size=80), offset=u64(),
                     device_uuid=st.text(max_size=40))
    location = st.one_of(
        st.builds(pb.BufferLocation, name=st.sampled_from(["kv0", "kv1", "ssm", "x"]),
                  nbytes=u64(), shm=memory),
        st.builds(pb.BufferLocation, name=st.sampled_from(["kv0", "kv1", "ssm"]), nbytes=u64(),
                  cuda=cuda))
    return mostly(usual, st.lists(location, max_size=4), 0.5)


def requests_for(world: World, worker: Worker):
    kc = keys_and_checks(world, worker)
    wid = mostly(st.just(worker.id), st.one_of(
        st.sampled_from(sorted(w.id for w in world.workers.values())), st.text(max_size=30)), 0.9)
    page_rows, slot_rows = worker.layout.page_rows, worker.layout.slot_rows

    def rows_for(keys: bytes):  # one distinct row per page mostly, else anything
        n = min(len(keys) // 16, page_rows)
        return mostly(st.permutations(range(page_rows)).map(lambda p: p[:n]),
                      st.lists(mostly(st.integers(0, page_rows - 1), u32()), max_size=12), 0.9)

    def checkpoints_for(keys: bytes):  # mostly the state at the prompt's end
        end = st.integers(0, slot_rows - 1).map(lambda slot: [pb.Checkpoint(pages=len(keys) // 16, slot=slot)])
        return mostly(end, st.lists(st.builds(pb.Checkpoint, pages=mostly(st.integers(1, 6), u32()),
                                              slot=mostly(st.integers(0, slot_rows - 1), u32())),
                                    max_size=3), 0.8)
    kcr = kc.flatmap(lambda k: st.tuples(st.just(k), rows_for(k[0]), checkpoints_for(k[0])))
    slot = mostly(st.integers(0, slot_rows - 1), st.one_of(st.none(), u32()))
    event = mostly(st.just(b""), st.binary(max_size=80), 0.95)
    signal = mostly(st.none(), st.builds(pb.Signal, slot=u32(), value=u32()), 0.9)
    return st.one_of(
        st.builds(lambda w, k, p: ("Match", pb.MatchRequest(worker_id=w, keys=k[0], checks=k[1],
                                                            prefetch=p)), wid, kc, st.booleans()),
        st.builds(lambda w, kr, s, e, a, g: ("Load", pb.LoadRequest(
            worker_id=w, keys=kr[0][0], checks=kr[0][1], kv_rows=kr[1], slot=s, ready_event=e,
            asynchronous=a, signal=g)), wid, kcr, slot, event, st.booleans(), signal),
        st.builds(lambda w, kr, d, e, a, g: ("Store", pb.StoreRequest(
            worker_id=w, keys=kr[0][0], checks=kr[0][1], kv_rows=kr[1], checkpoints=kr[2],
            durable=d, ready_event=e, asynchronous=a, signal=g)), wid, kcr,
            mostly(st.just(False), st.just(True), 0.9), event, st.booleans(), signal),
        st.builds(lambda w, g: ("Settle", pb.SettleRequest(worker_id=w, signal=g)), wid, signal),
        st.builds(lambda w, k, t: ("Evict", pb.EvictRequest(worker_id=w, keys=k[0], tier=t)), wid, kc,
                  mostly(st.sampled_from([0, 1, 2, 4]), st.integers(-2**31, 2**31 - 1))),
        st.just(("Stats", pb.StatsRequest())),
        st.builds(lambda w: ("Unregister", pb.UnregisterRequest(worker_id=w)), st.text(max_size=30)),
        st.builds(lambda w, t, o: ("OpenLane", pb.OpenLaneRequest(worker_id=w, lane=pb.SharedMemoryBuffer(
            ticket=t, offset=o))), wid, st.sampled_from([FRESH, FRESH, b"\0" * 16, b"", b"x" * 40]), u64()),
        st.builds(lambda m, lay, b, x, h: ("Register", pb.RegisterRequest(
            model_id=m, layout=lay, buffers=b, extra_keys=x, hash=h)),
            st.one_of(st.just(prompts.MODEL), st.text(max_size=30)), layouts(), buffer_locations(),
            st.lists(st.text(max_size=20), max_size=3),
            st.sampled_from(["", "xxh3_128", "blake2b_128", "md5", "\x00"])))


def steps(world: World):
    """((method, request), context, way): a call as one of the four workers would make it;
    with a way (call's docstring), a Match, Load or Store goes on a Calls stream or through
    a lane, with a timeout of seconds or anything."""
    timeout = mostly(st.just(0.0), st.floats())

    def way(ns):  # mostly the worker's own lane
        return st.one_of(st.none(), st.tuples(st.just("stream"), timeout), st.tuples(
            st.just("lane"), timeout, mostly(st.just(ns), st.sampled_from(NAMESPACES), 0.8)))
    return st.sampled_from(NAMESPACES).flatmap(lambda ns: st.tuples(
        requests_for(world, world.workers[ns]), contexts(world, ns[0]), way(ns)))


# -- the run --------------------------------------------------------------------------------
@dataclass
class Outcome:
    calls: collections.Counter = field(default_factory=collections.Counter)
    codes: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    foreign: int = 0  # loaded entries no store of the caller's namespace offered
    loaded_entries: int = 0  # pages and checkpoints loaded and checked
    invariant_checks: int = 0


def run(examples: int, seed: int = 0, folder: Path | None = None) -> Outcome:
    outcome = Outcome()
    with tempfile.TemporaryDirectory() as scratch:
        world = build_world(Path(folder or scratch))

        @hypothesis.seed(seed)
        @settings(max_examples=examples, database=None, deadline=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(steps(world))
        def one(step):
            (method, message), context, way = step
            way = way if method in STREAMED else None
            outcome.calls[method if way is None else {"stream": "Calls", "lane": "lane"}[way[0]]] += 1
            try:
                reply, wrong = fuzzed_call(world, method, message, context, way)
            except BaseException:  # noqa: BLE001 - anything escaping is a finding
                outcome.failures.append(f"{method} raised: {message!r:.300}\n{traceback.format_exc()}")
                return
            code = reply if isinstance(reply, grpc.StatusCode) else None
            outcome.codes[code.name if code else "OK"] += 1
            if code is not None and code not in ALLOWED:
                outcome.failures.append(f"{method} -> {code.name}: {message!r:.300}")
            if method == "Load" and code is None:
                outcome.loaded_entries += reply.match.pages + bool(reply.match.pages)
            if wrong:
                outcome.foreign += len(wrong)
                outcome.failures.append(f"{method} put foreign bytes in {wrong}: {message!r:.300}")
            outcome.invariant_checks += 1
            broken = invariants.violations(world.engine)
            if broken:
                outcome.failures.append(f"the books do not balance after {method}: {broken}")

        one()
        if not still_serves(world):
            outcome.failures.append("a stored prompt no longer loads exactly")
        world.servicer.registry.remove_all()
        world.handover.stop()
        world.engine.close(flush=False)
    return outcome


def still_serves(world: World) -> bool:
    """After the fuzzing: a prompt stored anew by each namespace loads whole and exact."""
    for worker in world.workers.values():
        context = token_context(worker.tenant)
        keys, checks = b"".join(worker.keys[0]), worker.checks[0]
        call(world, "Evict", pb.EvictRequest(worker_id=worker.id, keys=keys), context)
        store = pb.StoreRequest(worker_id=worker.id, keys=keys, checks=checks,
                                kv_rows=range(prompts.PAGES),
                                checkpoints=[pb.Checkpoint(pages=prompts.PAGES, slot=0)])
        prepare_store(world, worker, store, worker.tenant)
        call(world, "Store", store, context)
        load = pb.LoadRequest(worker_id=worker.id, keys=keys, checks=checks,
                              kv_rows=range(prompts.PAGES, 2 * prompts.PAGES), slot=1)
        before = [t.clone() for t in sum(worker.rows, [])]
        reply = call(world, "Load", load, context)
        if (isinstance(reply, grpc.StatusCode) or reply.match.pages != prompts.PAGES
                or foreign_bytes(world, worker, load, reply, before)):
            return False
    return True


# -- raw bytes against a daemon process --------------------------------------------------
METHODS = ("Register", "Unregister", "Match", "Load", "Store", "Evict", "Stats", "Settle", "Calls",
           "OpenLane")


def run_raw(messages: int, seed: int = 0) -> tuple[collections.Counter, bool]:
    """Random bytes as requests to every method of a daemon process; (codes, whether the
    daemon still serves afterwards)."""
    from tiercache_service.process import spawn
    from tiercache.client import Client
    rng = np.random.default_rng(seed)
    codes: collections.Counter = collections.Counter()
    with tempfile.TemporaryDirectory() as folder, spawn(folder, "--host-budget", "16MiB",
                                                        "--disk-map-size", "64MiB", forward_output=True) as (address, daemon):
        channel = grpc.insecure_channel(address)
        for n in range(messages):
            method = METHODS[n % len(METHODS)]
            path = f"/tiercache.v1.Tiercache/{method}"
            payload = rng.bytes(int(rng.choice([0, 1, 8, 64, 512, 4096])))
            try:
                if method == "Register":
                    next(channel.unary_stream(path)(payload, timeout=10))
                    codes["OK"] += 1  # a registration of garbage went through: the stream ends
                elif method == "Calls":
                    next(channel.stream_stream(path)(iter([payload]), timeout=10))
                    codes["OK"] += 1
                else:
                    channel.unary_unary(path)(payload, timeout=10)
                    codes["OK"] += 1
            except grpc.RpcError as error:
                codes[error.code().name] += 1
            except StopIteration:
                codes["stream ended"] += 1
        alive = daemon.poll() is None and Client(address).stats() is not None
        channel.close()
    return codes, alive


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=100_000)
    parser.add_argument("--raw", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.time()
    outcome = run(args.examples, args.seed)
    structured = time.time() - start
    raw_codes, alive = run_raw(args.raw, args.seed)
    for failure in outcome.failures[:20]:
        print("FAILURE:", failure)
    print_table(f"structured fuzzing: {args.examples} inputs in {structured:.0f} s",
                ["rpc", "inputs"], sorted(outcome.calls.items()))
    print_table("statuses answered (structured)", ["status", "calls"], outcome.codes.most_common())
    print_table(f"raw bytes: {args.raw} requests to a daemon process", ["status", "calls"],
                raw_codes.most_common())
    print("peer: Redis's corrupt-payload fuzzer must end with 0 crashes; ours also counts "
          "INTERNAL/UNKNOWN statuses (uncaught exceptions) as failures")
    print_summary(inputs=sum(outcome.calls.values()), failures=len(outcome.failures),
                  internal=outcome.codes.get("INTERNAL", 0), invariant_checks=outcome.invariant_checks,
                  loaded_entries=outcome.loaded_entries, foreign_bytes=outcome.foreign,
                  raw_requests=args.raw, daemon_alive=int(alive))


if __name__ == "__main__":
    main()
