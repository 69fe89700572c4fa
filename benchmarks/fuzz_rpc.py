"""Fuzz every RPC with structure-aware random messages (hypothesis), then with raw bytes.

Structured: the servicer runs in this process behind the daemon's error interceptor, on
a real engine (host and disk tiers), a registry with a secret and a tenants config.
Hypothesis builds each RPC's message field by field: worker ids that exist, belong to
another tenant or do not; keys and checks of every length, and those of stored prompts;
row ids, slots and checkpoints in and out of range; layouts with odd shapes, sizes and
dtypes; buffer locations naming this fuzzer's shared memory, missing objects, paths and
CUDA handles; credentials that are valid, another tenant's, malformed or absent;
deadlines already past. An input fails the run if its call raises anything but a
deliberate abort, or aborts with INTERNAL or UNKNOWN (an exception nobody meant). Every
few hundred inputs the engine's books are checked, and at the end a stored prompt must
still load exactly.

Raw: random bytes as the request of each method, to a daemon process: the daemon must
answer each call (grpc's INTERNAL for what it cannot parse is fine) and keep serving.

    python -m benchmarks.fuzz_rpc [--examples 100000] [--raw 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import hypothesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from benchmarks.common import print_summary, print_table
from service.auth import Authenticator, Tenant, _digest
from service.errors import ErrorInterceptor
from service.servicer import TiercacheServicer
from service.workers import WorkerRegistry
from tests.reliability import keyed, prompts
from tiercache.engine import Engine, EngineConfig
from tiercache.hashing import page_chain
from tiercache.index import Tier
from tiercache.shm import SharedBuffers
from tiercache.tiers.disk import DiskConfig
from tiercache.tiers.host import HostConfig
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import layout_to_proto

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAUTHENTICATED,
           grpc.StatusCode.PERMISSION_DENIED}
TOKENS = {"acme": "acme-token", "beta": "beta-token"}
MAX_PAGES = 256


class Aborted(Exception):
    pass


class Context:
    """What a servicer sees of a call, as the fuzzer chose it."""

    def __init__(self, metadata: tuple, peer: str, names: list[bytes], remaining: float | None):
        self.metadata, self.peer_name, self.names, self.remaining = metadata, peer, names, remaining
        self.callbacks: list = []
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self):
        return self.metadata

    def peer(self) -> str:
        return self.peer_name

    def auth_context(self) -> dict:
        return {"x509_common_name": self.names} if self.names else {}

    def time_remaining(self):
        return self.remaining

    def is_active(self) -> bool:
        return True

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def abort(self, code, details):
        self.code = code
        raise Aborted(details)

    def end(self) -> None:
        for callback in self.callbacks:
            callback()


@dataclass
class World:
    servicer: TiercacheServicer
    engine: Engine
    shared: SharedBuffers
    workers: dict[str, str]  # tenant -> worker id registered at the start
    keys: list[bytes]  # packed keys of the stored prompt, as acme's worker sends them
    checks: bytes
    handlers: dict = field(default_factory=dict)


def guarded(servicer: TiercacheServicer, method: str, streaming: bool):
    make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
    handler = make(getattr(servicer, method))

    class Details:
        pass
    details = Details()
    details.method = f"/tiercache.v1.Tiercache/{method}"
    wrapped = ErrorInterceptor().intercept_service(lambda _: handler, details)
    return wrapped.unary_stream if streaming else wrapped.unary_unary


def locations(shared: SharedBuffers) -> list[pb.BufferLocation]:
    return [pb.BufferLocation(name=p.spec.name, nbytes=p.nbytes,
                              shm=pb.SharedMemoryBuffer(name=shared.name, offset=p.offset))
            for p in shared.placements]


def build_world(folder: Path) -> World:
    engine = Engine.open(EngineConfig(host=HostConfig(budget_bytes=1 << 20, pin=False),
                                      disk=DiskConfig(str(folder / "lmdb"), map_size=1 << 26, sync=False)))
    tenants = {name: Tenant(name, (_digest(token),), (f"{name}-worker",))
               for name, token in TOKENS.items()}
    registry = WorkerRegistry(16, engine.quiesce, secret=b"s" * 32, max_per_tenant=6)
    servicer = TiercacheServicer(engine, registry, MAX_PAGES, Authenticator(tenants))
    shared = SharedBuffers.create(prompts.LAYOUT)
    workers = {}
    for tenant, token in TOKENS.items():
        context = Context((("authorization", f"Bearer {token}"),), "unix:", [], None)
        reply = next(servicer.Register(pb.RegisterRequest(
            model_id=prompts.MODEL, layout=layout_to_proto(prompts.LAYOUT),
            buffers=locations(shared)), context))
        workers[tenant] = reply.worker_id
        if tenant == "acme":
            root = reply.namespace_root
    chain = page_chain(prompts.tokens(0), root, prompts.PAGE)
    world = World(servicer, engine, shared, workers, chain.keys, chain.checks.tobytes())
    for method in ("Match", "Load", "Store", "Evict", "Stats", "Unregister"):
        world.handlers[method] = guarded(servicer, method, False)
    world.handlers["Register"] = guarded(servicer, "Register", True)
    store_prompt(world)
    return world


def buffers(world: World) -> tuple[list, list]:
    rows = keyed.byte_rows(world.shared.tensors)  # kv0, kv1, ssm: layout order
    return rows[:2], rows[2:]


def store_prompt(world: World) -> None:
    """acme's prompt 0, stored afresh with keyed content."""
    keys = b"".join(world.keys)
    call(world, "Evict", pb.EvictRequest(worker_id=world.workers["acme"], keys=keys), acme_context())
    keyed.fill(*buffers(world), world.keys, list(range(prompts.PAGES)), 0)
    call(world, "Store", pb.StoreRequest(worker_id=world.workers["acme"], keys=keys,
                                         checks=world.checks, kv_rows=range(prompts.PAGES),
                                         checkpoints=[pb.Checkpoint(pages=prompts.PAGES, slot=0)]),
         acme_context())


def acme_context() -> Context:
    return Context((("authorization", f"Bearer {TOKENS['acme']}"),), "unix:", [], None)


def call(world: World, method: str, request, context: Context):
    """One call as gRPC would make it; returns the reply or the abort's code."""
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


# -- strategies -----------------------------------------------------------------------------
# Each field is mostly something a real worker would send, so that calls get past the
# first check and into the engine, and otherwise anything at all.
def mostly(usual, odd, share: float = 0.75):
    return st.floats(0, 1).flatmap(lambda x: usual if x < share else odd)


def u32(): return mostly(st.integers(0, 24), st.integers(0, 2**32 - 1))
def u64(): return mostly(st.integers(0, 1 << 16), st.integers(0, 2**64 - 1))


def contexts(world: World):
    acme = (("authorization", f"Bearer {TOKENS['acme']}"),)
    metadata = mostly(st.just(acme), st.one_of(
        st.just(()),
        st.sampled_from([(("authorization", f"Bearer {t}"),) for t in TOKENS.values()]),
        st.builds(lambda v: (("authorization", v),), st.text(max_size=40)),
        st.lists(st.tuples(st.sampled_from(["authorization", "x-other"]),
                           st.text(max_size=20)), max_size=3).map(tuple)))
    names = mostly(st.just([]), st.lists(st.sampled_from(
        [b"acme-worker", b"beta-worker", b"stranger", b"\xff\xfe"]), min_size=1, max_size=2))
    remaining = mostly(st.none(), st.one_of(st.just(0.0), st.floats(-5, 30)), 0.85)
    return st.builds(Context, metadata, st.sampled_from(["unix:", "ipv4:10.0.0.1:5000"]), names,
                     remaining)


def worker_ids(world: World):
    return mostly(st.just(world.workers["acme"]), st.one_of(
        st.sampled_from(sorted(world.workers.values())), st.text(max_size=30)))


def keys(world: World):
    stored = b"".join(world.keys)
    return mostly(st.integers(1, prompts.PAGES).map(lambda n: stored[:16 * n]), st.one_of(
        st.binary(max_size=40 * 16).map(lambda b: b[:len(b) // 16 * 16]),
        st.binary(max_size=300),
        st.integers(MAX_PAGES - 1, MAX_PAGES + 2).map(lambda n: b"\x07" * 16 * n)), 0.5)


def checks_for(world: World):
    return st.one_of(st.just(b""), st.just(world.checks), st.binary(max_size=64))


def layouts():
    specs = st.builds(pb.BufferSpec, name=st.one_of(st.sampled_from(["kv0", "kv1", "ssm"]),
                                                     st.text(max_size=8)),
                      rows=u64(), row_shape=st.lists(u64(), max_size=4),
                      dtype=st.sampled_from(["bfloat16", "float32", "uint8", "int4", "", "bool"]))
    return mostly(st.just(layout_to_proto(prompts.LAYOUT)), st.builds(
        pb.Layout, page_tokens=u32(), paged=st.lists(specs, max_size=4),
        slots=st.lists(specs, max_size=3), tp_rank=u32(), tp_size=u32()), 0.5)


def buffer_locations(world: World):
    names = st.sampled_from([world.shared.name, "tiercache-missing", "../../etc/passwd", "",
                             ".hidden", "a/b"])
    shm = st.builds(pb.SharedMemoryBuffer, name=names, offset=u64())
    cuda = st.builds(pb.CudaIpcBuffer, handle=st.binary(max_size=80), offset=u64(),
                     device_uuid=st.text(max_size=40))
    location = st.one_of(
        st.builds(pb.BufferLocation, name=st.sampled_from(["kv0", "kv1", "ssm", "x"]),
                  nbytes=u64(), shm=shm),
        st.builds(pb.BufferLocation, name=st.sampled_from(["kv0", "kv1", "ssm"]), nbytes=u64(),
                  cuda=cuda))
    return mostly(st.just(locations(world.shared)), st.lists(location, max_size=4), 0.5)


def requests(world: World):
    wid, ks, cs = worker_ids(world), keys(world), checks_for(world)
    rows = mostly(st.lists(st.integers(0, 19), max_size=6, unique=True), st.lists(u32(), max_size=12))
    slot = mostly(st.integers(0, 3), st.one_of(st.none(), u32()))
    checkpoints = st.lists(st.builds(pb.Checkpoint, pages=mostly(st.integers(1, 5), u32()),
                                     slot=mostly(st.integers(0, 3), u32())), max_size=4)
    event = mostly(st.just(b""), st.binary(max_size=80), 0.9)
    return st.one_of(
        st.tuples(st.just("Match"), st.builds(pb.MatchRequest, worker_id=wid, keys=ks,
                                              prefetch=st.booleans(), checks=cs)),
        st.tuples(st.just("Load"), st.builds(
            pb.LoadRequest, worker_id=wid, keys=ks, kv_rows=rows, slot=slot, checks=cs,
            ready_event=event,
            asynchronous=st.booleans())),
        st.tuples(st.just("Store"), st.builds(
            pb.StoreRequest, worker_id=wid, keys=ks, kv_rows=rows, checkpoints=checkpoints,
            checks=cs, durable=st.booleans(),
            ready_event=event)),
        st.tuples(st.just("Evict"), st.builds(pb.EvictRequest, worker_id=wid, keys=ks, tier=mostly(
            st.sampled_from([0, 1, 2, 4]), st.integers(-2**31, 2**31 - 1)))),
        st.tuples(st.just("Stats"), st.just(pb.StatsRequest())),
        st.tuples(st.just("Unregister"), st.builds(pb.UnregisterRequest, worker_id=st.text(max_size=30))),
        st.tuples(st.just("Register"), st.builds(
            pb.RegisterRequest, model_id=st.one_of(st.just(prompts.MODEL), st.text(max_size=30)),
            layout=layouts(), buffers=buffer_locations(world),
            extra_keys=st.lists(st.text(max_size=20), max_size=3),
            hash=st.sampled_from(["", "xxh3_128", "blake2b_128", "md5", "\x00"]))))


# -- the run --------------------------------------------------------------------------------
@dataclass
class Outcome:
    calls: collections.Counter = field(default_factory=collections.Counter)
    codes: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    invariant_checks: int = 0


def books_balance(engine: Engine) -> bool:
    """The engine's own accounting agrees with itself and nothing stays pinned."""
    with engine._lock:
        rows = engine.index.rows_in(Tier.HOST)
        charged = np.maximum(engine.index.column("nbytes", rows), engine.host.min_slot_bytes)
        return (engine.host.used_bytes == int(charged.sum())  # tiny entries take a floor
                and not engine.index.column("pins", engine.index.rows_in(Tier.HOST | Tier.DISK)).any())


def run(examples: int, seed: int = 0, folder: Path | None = None) -> Outcome:
    outcome = Outcome()
    with tempfile.TemporaryDirectory() as scratch:
        world = build_world(Path(folder or scratch))

        @hypothesis.seed(seed)
        @settings(max_examples=examples, database=None, deadline=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(requests(world), contexts(world))
        def one(request, context):
            method, message = request
            outcome.calls[method] += 1
            try:
                result = call(world, method, message, context)
            except BaseException:  # noqa: BLE001 - anything escaping is a finding
                outcome.failures.append(f"{method} raised: {message!r:.300}\n{traceback.format_exc()}")
                return
            code = result if isinstance(result, grpc.StatusCode) else None
            outcome.codes[code.name if code else "OK"] += 1
            if code is not None and code not in ALLOWED:
                outcome.failures.append(f"{method} -> {code.name}: {message!r:.300}")
            if sum(outcome.calls.values()) % 500 == 0:
                outcome.invariant_checks += 1
                if not books_balance(world.engine):
                    outcome.failures.append(f"the books do not balance after {method}")

        one()
        if not books_balance(world.engine):
            outcome.failures.append("the books do not balance at the end")
        if not still_serves(world):
            outcome.failures.append("the stored prompt no longer loads exactly")
        world.servicer.registry.remove_all()
        world.shared.close()
        world.engine.close(flush=False)
    return outcome


def still_serves(world: World) -> bool:
    """After the fuzzing (which may have evicted or overwritten it): a prompt stored anew
    loads whole and exact."""
    store_prompt(world)
    reply = call(world, "Load", pb.LoadRequest(
        worker_id=world.workers["acme"], keys=b"".join(world.keys), checks=world.checks,
        kv_rows=range(prompts.PAGES, 2 * prompts.PAGES), slot=1), acme_context())
    if isinstance(reply, grpc.StatusCode) or reply.match.pages != prompts.PAGES:
        return False
    return keyed.wrong_entries(*buffers(world), world.keys,
                               list(range(prompts.PAGES, 2 * prompts.PAGES)), prompts.PAGES, 1) == 0


# -- raw bytes against a daemon process --------------------------------------------------
METHODS = ("Register", "Unregister", "Match", "Load", "Store", "Evict", "Stats")


def run_raw(messages: int, seed: int = 0) -> tuple[collections.Counter, bool]:
    """Random bytes as requests to every method of a daemon process; (codes, whether the
    daemon still serves afterwards)."""
    from service.process import spawn
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
                  raw_requests=args.raw, daemon_alive=int(alive))


if __name__ == "__main__":
    main()
