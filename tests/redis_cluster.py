"""A real Redis Cluster on loopback for tests and benchmarks: redis-server processes on
ports picked here, formed with `redis-cli --cluster create`, stopped by pid.

Needs Debian's redis-server and redis-tools (`.ci/run` installs them).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from tests.polling import eventually

needs_redis = pytest.mark.skipif(
    (shutil.which("redis-server") is None or shutil.which("redis-cli") is None)
    and not os.environ.get("CI"),
    reason="redis-server/redis-cli are not installed here (apt-get install redis-server "
           "redis-tools; .ci/run does)")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """Ports p, each with p + 10000 (its cluster bus) free as well."""
    found: list[int] = []
    while len(found) < count:
        port = random.randint(20000, 50000)
        if port not in found and _free(port) and _free(port + 10000):
            found.append(port)
    return found


@dataclass
class Node:
    port: int
    directory: Path
    process: subprocess.Popen

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cli(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True,
                              text=True, timeout=30)
        if check and done.returncode:
            raise RuntimeError(f"redis-cli {args} on {self.port}: {done.stderr}{done.stdout}")
        return done.stdout.strip()

    def raw(self, *args: bytes) -> bytes:
        """One command over a plain socket (for binary arguments redis-cli cannot take)."""
        parts = [b"*%d\r\n" % len(args)] + [b"$%d\r\n%s\r\n" % (len(a), a) for a in args]
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as conn:
            conn.sendall(b"".join(parts))
            reply = conn.recv(1 << 16)
        if reply.startswith(b"-"):
            raise RuntimeError(f"{args[0]!r} on {self.port}: {reply!r}")
        return reply

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL by pid: the node vanishes as a crashed one does."""
        if self.alive:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)  # holds its sockets, answers nothing

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def node_id(self) -> str:
        return self.cli("cluster", "myid")


@dataclass
class Cluster:
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(n.address for n in self.nodes)

    def owner(self, key: bytes) -> Node:
        """The node that serves `key`'s slot now."""
        slot = int(self.nodes[0].cli("cluster", "keyslot", key.decode()))
        for node in self.nodes:
            if node.alive and str(slot) in _slots_of(node):
                return node
        raise LookupError(f"no live node serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            if node.alive:
                node.resume()  # a paused node would ignore SIGTERM until resumed
                node.process.terminate()
        for node in self.nodes:
            try:
                node.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.kill()


def _slots_of(node: Node) -> set[str]:
    """Slots `node` serves, by its own view (CLUSTER SHARDS is newer than Debian's 7.0)."""
    own = node.node_id()
    slots: set[str] = set()
    for line in node.cli("cluster", "nodes").splitlines():
        fields = line.split()
        if fields[0] != own:
            continue
        for span in fields[8:]:
            if span.startswith("["):
                continue  # a slot migrating or importing
            lo, _, hi = span.partition("-")
            slots.update(str(s) for s in range(int(lo), int(hi or lo) + 1))
    return slots


def _start_node(directory: Path, port: int, maxmemory: str, policy: str) -> Node:
    directory.mkdir(parents=True, exist_ok=True)
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
               "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
               "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no",
               "--dir", str(directory), "--save", "", "--appendonly", "no",
               "--maxmemory", maxmemory, "--maxmemory-policy", policy,
               "--logfile", "redis.log", "--daemonize", "no"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return Node(port, directory, process)


def _ready_node(directory: Path, maxmemory: str, policy: str, attempts: int = 3) -> Node:
    """A node that answers PING. A port picked free may be taken before redis binds it
    (tests run beside other processes): then it tries another."""
    for attempt in range(attempts):
        node = _start_node(directory, free_ports(1)[0], maxmemory, policy)
        try:
            _wait(lambda: not node.alive or node.cli("ping", check=False) == "PONG",
                  f"redis on {node.port}", seconds=15)
        except RuntimeError:
            pass
        if node.alive and node.cli("ping", check=False) == "PONG":
            return node
        node.kill()
        (directory / "nodes.conf").unlink(missing_ok=True)
    raise RuntimeError(f"redis-server did not start in {attempts} attempts: see {directory}/redis.log")


def _wait(condition, what: str, seconds: float = 30.0) -> None:
    if not eventually(condition, seconds):
        raise RuntimeError(f"timed out waiting for {what}")


@contextmanager
def redis_cluster(directory: Path, masters: int = 3, maxmemory: str = "512mb",
                  policy: str = "allkeys-lru") -> Iterator[Cluster]:
    """A cluster of `masters` nodes without replicas; stopped at the end."""
    cluster = Cluster()
    try:
        for i in range(masters):
            cluster.nodes.append(_ready_node(directory / f"node{i}", maxmemory, policy))
        subprocess.run(["redis-cli", "--cluster", "create", *(n.address for n in cluster.nodes),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        for node in cluster.nodes:
            _wait(lambda: "cluster_state:ok" in node.cli("cluster", "info"),
                  f"the cluster to form on {node.port}")
        yield cluster
    finally:
        cluster.stop()
