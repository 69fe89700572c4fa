"""The red team's findings, each attacked again over a real daemon's own sockets as a
hostile or buggy worker would: one tenant never reads another's bytes, and no client
crashes the daemon or shuts the others out (invariants 5 and 6).

The buffer attacks (shrinking, symlinks, naming another worker's memory, descriptors)
are on the memfd handover: buffers are sealed anonymous files passed as descriptors,
never opened by name.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from tiercache_service.handover import handover_path
from drills import certs, keyed, prompts
from tests.service.daemon import running_daemon
from tiercache import shm
from tiercache.client import Client, Tls
from tiercache.errors import FailedPrecondition, InvalidArgument, TiercacheError
from tiercache.layout import BufferSpec, Layout
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import layout_to_proto

MiB = 1 << 20
TENANTS = '[tenants.acme]\ntokens = ["acme-token"]\n[tenants.beta]\ntokens = ["beta-token"]\n'
# pages four times those of prompts.LAYOUT, and a checkpoint of another size
LARGE = Layout(prompts.PAGE, paged=(BufferSpec("kv0", 4 * prompts.PAGES, (prompts.PAGE, 2, 32),
                                               "bfloat16"),),
               slots=(BufferSpec("ssm", 4, (16, 16), "float32"),))

BIG = Layout(prompts.PAGE, paged=(BufferSpec("kv0", 4 * prompts.PAGES, (prompts.PAGE, 8, 64),
                                             "bfloat16"),), slots=LARGE.slots)  # 16 KiB pages


def tenants_file(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tenants.toml"
    path.write_text(TENANTS)
    path.chmod(0o600)
    return str(path)


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


def store(worker, prompt: int, durable: bool = False):
    paged, slots = keyed.byte_rows(worker.paged), keyed.byte_rows(worker.slots)
    keys = worker.keys(prompts.tokens(prompt))
    keyed.fill(paged, slots, keys, list(range(prompts.PAGES)), 0)
    return worker.store(keys=keys, kv_rows=range(prompts.PAGES),
                        checkpoints={prompts.PAGES * prompts.PAGE: 0}, durable=durable)


def loads_exactly(worker, prompt: int, keys=None) -> int:
    """Pages loaded of `prompt` (into rows the store did not use), each checked byte for
    byte; rows not loaded must be left as they were."""
    paged, slots = keyed.byte_rows(worker.paged), keyed.byte_rows(worker.slots)
    keys = keys or worker.keys(prompts.tokens(prompt))
    rows = list(range(prompts.PAGES, 2 * prompts.PAGES))
    keyed.poison(paged), keyed.poison(slots)
    pages = worker.load(keys=keys, kv_rows=rows, slot=1).match.pages
    assert keyed.wrong_entries(paged, slots, keys, rows, pages, 1) == 0
    untouched = [r for r in range(paged[0].shape[0]) if r not in rows[:pages]]
    assert all((buffer[untouched] == 0xA5).all() for buffer in paged)
    return pages


# -- 1. a key repeated inside one request --------------------------------------------------
def test_a_store_that_repeats_a_key_is_refused_and_the_index_stays_whole(tmp_path):
    with running_daemon(tmp_path, "--host-budget", "1MiB") as (address, _):
        client = Client(address)
        worker = client.register(prompts.MODEL, prompts.LAYOUT)
        keys = worker.keys(prompts.tokens(0))
        # the attack: K || K from rows 0 and 1
        with pytest.raises(InvalidArgument, match="key 1 repeats key 0"):
            worker.store(keys=[keys[0], keys[0]], kv_rows=[0, 1])
        for call in (lambda: worker.match(keys=keys + keys[:1]), lambda: worker.evict(keys=keys[:1] * 2),
                     lambda: worker.load(keys=keys + keys[:1], kv_rows=range(6), slot=1)):
            with pytest.raises(InvalidArgument, match="repeats key"):
                call()
        assert sum(t.entries for t in client.stats().tiers) == 0  # nothing was stored
        # what the defect broke works: store, evict (a no-op forever before), store again
        # (it replied present=1 with nothing stored), a durable store (it hung)
        assert store(worker, 0).stored == prompts.PAGES + 1
        assert worker.evict(keys=keys) == prompts.PAGES + 1
        assert store(worker, 0).stored == prompts.PAGES + 1
        assert store(worker, 0, durable=True).present == prompts.PAGES + 1
        # many other tenants' entries later, under evictions, the prompt still loads exactly
        for prompt in range(1, 300):
            store(worker, prompt)
        assert loads_exactly(worker, 299) == prompts.PAGES
        worker.close()


# -- 2. entries of one layout read through another ------------------------------------------
def test_a_second_layout_never_reads_entries_of_the_first_or_of_another_tenant(tmp_path):
    tenants = tenants_file(tmp_path / "conf")
    with running_daemon(tmp_path / "data", "--tenants-file", tenants) as (address, _):
        beta = Client(address, token="beta-token").register(prompts.MODEL, LARGE)
        for prompt in range(40):  # the large pool fills with beta's entries
            store(beta, prompt)
        acme = Client(address, token="acme-token")
        small = acme.register(prompts.MODEL, prompts.LAYOUT)
        store(small, 0)
        large = acme.register(prompts.MODEL, LARGE)
        # the attack: the small layout's keys, loaded through the large layout's worker
        paged, slots = keyed.byte_rows(large.paged), keyed.byte_rows(large.slots)
        keyed.poison(paged), keyed.poison(slots)
        keys = small.keys(prompts.tokens(0))
        result = large.load(keys=keys, kv_rows=range(prompts.PAGES), slot=1)
        assert result.match.pages == 0 and large.match(keys=keys).pages == 0
        assert all((b == 0xA5).all() for b in paged + slots)  # not a byte delivered
        # each namespace still gets its own entries exactly
        assert loads_exactly(small, 0) == prompts.PAGES
        assert loads_exactly(beta, 39) == prompts.PAGES
        for worker in (beta, small, large):
            worker.close()


# -- 3, 4, 5, 9. buffers: sealed, never named, tied to whoever handed them over --------------
def test_registered_memory_cannot_shrink_under_the_daemon(tmp_path):
    with running_daemon(tmp_path, "--no-disk") as (address, daemon):
        shared = shm.SharedBuffers.create(prompts.LAYOUT)
        kept = os.dup(shared.fd)  # the hostile worker keeps a descriptor of its own
        ticket = shared.hand_over(address.removeprefix("unix:") + ".fds")
        stub = Client(address)._stub
        stream = stub.Register(pb.RegisterRequest(
            model_id=prompts.MODEL, layout=layout_to_proto(prompts.LAYOUT),
            buffers=[pb.BufferLocation(name=p.spec.name, nbytes=p.nbytes,
                                       shm=pb.SharedMemoryBuffer(ticket=ticket, offset=p.offset))
                     for p in shared.placements]))
        worker_id = next(stream).worker_id
        # the attack: ftruncate after registering. The seal refuses it.
        for size in (0, 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(kept, size)
        # so the daemon's next copies touch whole memory: it stores, loads, lives
        keys = b"".join(shm_keys(address))
        stub.Store(pb.StoreRequest(worker_id=worker_id, keys=keys, kv_rows=range(prompts.PAGES),
                                   checkpoints=[pb.Checkpoint(pages=prompts.PAGES, slot=0)]))
        reply = stub.Load(pb.LoadRequest(worker_id=worker_id, keys=keys,
                                         kv_rows=range(prompts.PAGES, 2 * prompts.PAGES), slot=1))
        assert reply.match.pages == prompts.PAGES and daemon.poll() is None
        os.close(kept)
        stream.cancel()


def shm_keys(address: str) -> list[bytes]:
    worker = Client(address).register(prompts.MODEL, prompts.LAYOUT)
    keys = worker.keys(prompts.tokens(0))
    worker.close()
    return keys


@pytest.mark.parametrize("what", ["unsealed memfd", "regular file", "directory", "fifo",
                                  "empty memfd", "two descriptors", "the daemon's secret"])
def test_only_sealed_memory_files_are_taken(tmp_path, what):
    with running_daemon(tmp_path, "--no-disk") as (address, daemon):
        path = handover_path(address.removeprefix("unix:"))
        fds = offered(tmp_path, what)
        try:
            with pytest.raises(FailedPrecondition, match="refused the buffers") as refused:
                if what == "two descriptors":
                    two = socket.socket(socket.AF_UNIX)
                    two.connect(path)
                    socket.send_fds(two, [shm.MAGIC], fds)
                    raise FailedPrecondition("the daemon refused the buffers: "
                                             + two.recv(512)[2:].decode())
                shm.hand_over(path, fds[0])
            assert "memfd" in str(refused.value) or "descriptor" in str(refused.value)
        finally:
            for fd in fds:
                os.close(fd)
        assert daemon.poll() is None
        assert Client(address).register(prompts.MODEL, prompts.LAYOUT).match(prompts.tokens(0)).pages == 0


def offered(folder: Path, what: str) -> list[int]:
    if what == "unsealed memfd":
        fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1 << 16)
        return [fd]
    if what == "empty memfd":
        fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
        import fcntl
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, shm.SEALS)
        return [fd]
    if what == "regular file":
        (folder / "plain").write_bytes(bytes(1 << 16))
        return [os.open(folder / "plain", os.O_RDWR)]
    if what == "directory":
        return [os.open(folder, os.O_RDONLY | os.O_DIRECTORY)]
    if what == "fifo":
        os.mkfifo(folder / "pipe")
        return [os.open(folder / "pipe", os.O_RDWR | os.O_NONBLOCK)]
    if what == "the daemon's secret":
        return [os.open(folder / "secret", os.O_RDONLY)]
    first = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    return [first, os.dup(first)]


def test_tickets_name_only_the_memory_their_worker_handed_over_once(tmp_path):
    tenants = tenants_file(tmp_path / "conf")
    with running_daemon(tmp_path / "data", "--tenants-file", tenants) as (address, _):
        shared = shm.SharedBuffers.create(prompts.LAYOUT)
        ticket = shared.hand_over(handover_path(address.removeprefix("unix:")))

        def register(token: str, ticket: bytes):
            return next(Client(address, token=token)._stub.Register(pb.RegisterRequest(
                model_id=prompts.MODEL, layout=layout_to_proto(prompts.LAYOUT),
                buffers=[pb.BufferLocation(name=p.spec.name, nbytes=p.nbytes,
                                           shm=pb.SharedMemoryBuffer(ticket=ticket, offset=p.offset))
                         for p in shared.placements]), metadata=(("authorization", f"Bearer {token}"),)))
        assert register("acme-token", ticket).worker_id
        # another tenant that learned the ticket, or a path where a name used to go:
        # nothing to map (once used, a ticket names nothing)
        for stolen in (ticket, b"/dev/shm/../../" + bytes(tmp_path / "data" / "secret"),
                       bytes(16)):
            with pytest.raises(grpc.RpcError) as refused:
                register("beta-token", stolen)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND


def test_registrations_keep_no_descriptor_and_a_failed_one_keeps_nothing(tmp_path):
    with running_daemon(tmp_path, "--no-disk") as (address, daemon):
        client = Client(address)
        client.register(prompts.MODEL, prompts.LAYOUT).close()  # warm up
        time.sleep(0.2)
        fds, maps = len(os.listdir(f"/proc/{daemon.pid}/fd")), memfd_maps(daemon.pid)
        workers = [client.register(prompts.MODEL, prompts.LAYOUT) for _ in range(20)]
        assert len(os.listdir(f"/proc/{daemon.pid}/fd")) <= fds + 2  # mapped, not kept open
        # too many buffers: refused with the limit named, before anything is mapped
        many = Layout(16, paged=tuple(BufferSpec(f"kv{i}", 2, (64,), "uint8") for i in range(2000)))
        with pytest.raises(InvalidArgument, match="more than the 1024"):
            client.register(prompts.MODEL, many)
        # a registration that fails after its handover keeps no mapping of it
        for _ in range(5):
            with pytest.raises(TiercacheError):
                client.register("", prompts.LAYOUT)
        for worker in workers:
            worker.close()
        deadline = time.time() + 10
        while memfd_maps(daemon.pid) > maps and time.time() < deadline:
            time.sleep(0.1)
        assert memfd_maps(daemon.pid) <= maps


def memfd_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("memfd:tiercache-buffers" in line for line in f)


# -- 6. a full file system under LMDB -----------------------------------------------------
def mounted_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True)
    return done.returncode == 0


def test_a_full_disk_is_an_error_on_disk_calls_and_the_daemon_serves_on(tmp_path):
    full = tmp_path / "full"
    if not mounted_tmpfs(full, "6m"):
        pytest.skip("mounting a tmpfs needs root (CI has it)")
    try:
        flags = ("--host-budget", "2MiB", "--disk-map-size", "64MiB", "--no-disk-sync")
        with running_daemon(full / "data", *flags) as (address, daemon):
            worker = Client(address).register(prompts.MODEL, BIG)
            for prompt in range(200):  # 16 MiB through a 2 MiB host over a 6 MiB disk
                store(worker, prompt)
            with pytest.raises(TiercacheError, match="disk|durable"):
                for prompt in range(200, 220):
                    store(worker, prompt, durable=True)
            counters = Client(address).stats().counters
            assert counters["disk_write_errors"] > 0 and daemon.poll() is None
            assert loads_exactly(worker, 199) == prompts.PAGES  # memory still serves
            worker.close()
        assert daemon.returncode == 0  # stopped on SIGTERM, flushing what it could
        # and it starts again on the full disk, serving what LMDB committed
        with running_daemon(full / "data", *flags) as (address, daemon):
            worker = Client(address).register(prompts.MODEL, BIG)
            assert worker.match(prompts.tokens(0)).pages in (0, prompts.PAGES)
            worker.close()
    finally:
        subprocess.run(["umount", "-l", str(full)], check=False)


# -- 7. tiny entries --------------------------------------------------------------------
def test_tiny_entries_are_refused_and_bookkeeping_stays_bounded(tmp_path):
    with running_daemon(tmp_path, "--no-disk", "--host-budget", "16MiB") as (address, daemon):
        client = Client(address)
        with pytest.raises(InvalidArgument, match="under the 64 bytes"):
            client.register(prompts.MODEL, Layout(16, paged=(BufferSpec("kv", 8, (1,), "uint8"),)))
        tiny = Layout(16, paged=(BufferSpec("kv", 1 << 15, (64,), "uint8"),))
        worker = client.register(prompts.MODEL, tiny)
        keys = [k.to_bytes(16, "little") for k in range(1, (1 << 16) + 1)]
        before = rss_anon(daemon.pid)
        worker.store(keys=keys[:1], kv_rows=[0])  # one page: one slab, no list of its slots
        assert rss_anon(daemon.pid) - before < 4 * MiB
        for start in range(0, len(keys), 1 << 12):  # four times the entries the budget holds
            worker.store(keys=keys[start:start + (1 << 12)], kv_rows=range(1 << 12))
        entries = client.stats().tiers[0].entries
        assert entries == 16 * MiB // 1024  # each slot is charged at least 1 KiB
        # what the daemon holds: the budget's slabs, at most 256 bytes of books an entry, and
        # what calls and code need (measured: 2 MiB, then 28 MiB in all, 2026-11-23)
        assert rss_anon(daemon.pid) - before < 16 * MiB + entries * 256 + 16 * MiB
        worker.close()


# -- 8. calls that never send their request --------------------------------------------
def stalled(channel: grpc.Channel, metadata=()) -> tuple[grpc.Future, threading.Event]:
    """A Stats call that sends its headers and then nothing."""
    never = threading.Event()

    def requests():
        never.wait()
        yield pb.StatsRequest()
    call = channel.stream_unary("/tiercache.v1.Tiercache/Stats",
                                request_serializer=pb.StatsRequest.SerializeToString,
                                response_deserializer=pb.StatsResponse.FromString)
    return call.future(requests(), metadata=metadata, timeout=60), never


def health(channel: grpc.Channel) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.skipif(not certs.available() and not os.environ.get("CI"), reason="needs openssl")
def test_stalled_calls_starve_neither_other_tenants_nor_health(tmp_path):
    made = certs.make(tmp_path / "certs", ("acme-worker",))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        tcp = f"127.0.0.1:{probe.getsockname()[1]}"
    flags = ("--no-disk", "--tenants-file", tenants_file(tmp_path / "conf"), "--require-identity",
             "--tcp", tcp, "--tls-cert", str(made.server[0]), "--tls-key", str(made.server[1]),
             "--max-concurrent-rpcs", "8", "--max-calls-per-tenant", "4", "--request-seconds", "2")
    with running_daemon(tmp_path / "data", *flags) as (address, daemon):
        tls = grpc.ssl_channel_credentials(made.ca.read_bytes())
        channels = [grpc.secure_channel(tcp, tls) for _ in range(4)]
        # 100 calls without credentials, over TLS, that never send their request: each is
        # turned away at once, holding nothing
        strangers = [stalled(channels[n % 4]) for n in range(100)]
        for future, _ in strangers:
            assert future.exception(timeout=10).code() == grpc.StatusCode.UNAUTHENTICATED
        acme_token = (("authorization", "Bearer acme-token"),)
        # acme stalls ten calls: four take its slots, six are told at once
        acme = [stalled(channels[n % 4], acme_token) for n in range(10)]
        time.sleep(0.5)
        refused = [f for f, _ in acme if f.done()]
        assert len(refused) == 6
        assert all(f.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED for f in refused)
        # beta and the health checks are served meanwhile
        beta = Client(tcp, token="beta-token", tls=Tls(str(made.ca)))
        assert beta.stats().workers == 0 and health(channels[0])
        assert health(grpc.insecure_channel(address))
        # and acme's stalled calls are cut off after --request-seconds
        for future, _ in acme:
            assert future.exception(timeout=10) is not None
        assert Client(tcp, token="acme-token", tls=Tls(str(made.ca))).stats().workers == 0
        assert daemon.poll() is None


# -- hygiene -------------------------------------------------------------------------------
def test_echoed_input_is_cut_short(tmp_path):
    with running_daemon(tmp_path, "--no-disk") as (address, _):
        stub = Client(address)._stub
        with pytest.raises(grpc.RpcError) as refused:
            stub.Match(pb.MatchRequest(worker_id="w" * MiB, keys=bytes(16)), timeout=30)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(refused.value.details()) < 1000 and "cut short" in refused.value.details()


@pytest.mark.parametrize("name", ["", "a" * 300, "nul\0byte", "new\nline"])
def test_odd_buffer_names_are_invalid_arguments(tmp_path, name):
    with running_daemon(tmp_path, "--no-disk") as (address, _):
        layout = pb.Layout(page_tokens=16, paged=[pb.BufferSpec(name=name, rows=4, row_shape=[64],
                                                                dtype="uint8")])
        with pytest.raises(grpc.RpcError) as refused:
            next(Client(address)._stub.Register(pb.RegisterRequest(model_id="m", layout=layout)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_worker_id_of_a_megabyte_does_not_crash_the_error_path(tmp_path):
    # the long message used to fail as RESOURCE_EXHAUSTED in grpc-message
    with running_daemon(tmp_path, "--no-disk") as (address, daemon):
        stub = Client(address)._stub
        for method, request in (("Load", pb.LoadRequest(worker_id="x" * MiB, keys=bytes(16))),
                                ("Unregister", pb.UnregisterRequest(worker_id="y" * MiB))):
            with pytest.raises(grpc.RpcError) as refused:
                getattr(stub, method)(request, timeout=30)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert daemon.poll() is None and np.isscalar(Client(address).stats().workers)
