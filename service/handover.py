"""The daemon's end of the buffer handover (tiercache.shm): a Unix socket beside the gRPC
one where workers pass sealed memfds (SCM_RIGHTS) and get tickets to register them by.

Each connection is served by a thread of its own with a short timeout, at most
`MAX_CONNECTIONS` at a time, so a worker that connects and sends nothing delays nobody.
A descriptor is mapped and closed at once (no descriptor is kept per buffer); the mapping
waits under its ticket until a registration redeems it (a registration that fails drops
the tickets it named), or `TICKET_SECONDS` pass. At most `MAX_TICKETS` wait at a time,
`MAX_TICKETS_PER_PROCESS` of one process: a worker cannot pile up mappings it never
registers, nor keep other workers from handing theirs over.
The socket is created 0600 like the gRPC one, and SO_PEERCRED names who handed what over
in the log.
"""

from __future__ import annotations

import logging
import ctypes
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from tiercache import shm
from tiercache.errors import InvalidArgument, NotFound, ResourceExhausted, TiercacheError

log = logging.getLogger("tiercache.service")
MAX_CONNECTIONS = 16
MAX_TICKETS = 64
MAX_TICKETS_PER_PROCESS = 8
TICKET_SECONDS = 60.0
CONNECTION_SECONDS = 5.0
MAX_OBJECT_BYTES = 1 << 40


@dataclass
class _Offered:
    mapping: ctypes.Array
    pid: int
    since: float = field(default_factory=time.monotonic)


def handover_path(socket_path: str) -> str:
    """Where workers hand buffers to a daemon whose gRPC socket is `socket_path`."""
    return socket_path + ".fds"


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))
    return pid, uid


class Handover:
    def __init__(self, path: str) -> None:
        self.path = path
        self._listener: socket.socket | None = None
        self._tickets: dict[bytes, _Offered] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._stopping = threading.Event()

    def start(self) -> "Handover":
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # 0600: the daemon's user only, as the gRPC socket
        try:
            listener.bind(self.path)
        finally:
            os.umask(old)
        listener.listen(MAX_CONNECTIONS)
        self._listener = listener
        threading.Thread(target=self._accept, name="tiercache-handover", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
        with self._lock:
            self._tickets.clear()

    def discard(self, ticket: bytes) -> None:
        """Forget a ticket a failed registration named (if it is one)."""
        with self._lock:
            self._tickets.pop(bytes(ticket), None)

    def redeem(self, ticket: bytes) -> ctypes.Array:
        """The mapping a ticket stands for; each ticket is good for one registration."""
        with self._lock:
            self._expire()
            offered = self._tickets.pop(bytes(ticket), None)
        if offered is None:
            raise NotFound("unknown shared-memory ticket (tickets are good for one "
                                  f"registration, within {TICKET_SECONDS:.0f} s of the handover): "
                                  "hand the buffers over again")
        return offered.mapping

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed: stopping
            if not self._slots.acquire(blocking=False):
                self._answer(conn, b"NO" + b"too many handovers at once: retry")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(CONNECTION_SECONDS)
            pid, uid = _peer(conn)
            try:
                ticket = self._take(conn, pid)
                self._answer(conn, b"OK" + ticket)
                log.debug("took buffers from pid %d (uid %d)", pid, uid)
            except TiercacheError as error:
                self._answer(conn, b"NO" + str(error)[:400].encode())
                log.info("refused buffers from pid %d (uid %d): %s", pid, uid, error)
        except OSError as error:  # the worker left or stalled: nothing was kept
            log.info("a buffer handover broke off: %s", error)
        finally:
            conn.close()
            self._slots.release()

    def _take(self, conn: socket.socket, pid: int) -> bytes:
        message, fds, _, _ = socket.recv_fds(conn, len(shm.MAGIC), 4)
        try:
            if message != shm.MAGIC or len(fds) != 1:
                raise InvalidArgument(f"send {shm.MAGIC!r} with exactly one memfd attached "
                                      f"(got {len(fds)} descriptors)")
            mapping = shm.map_sealed(fds[0], MAX_OBJECT_BYTES)
        finally:
            for fd in fds:
                os.close(fd)
        ticket = secrets.token_bytes(shm.TICKET_BYTES)
        with self._lock:
            self._expire()
            mine = sum(o.pid == pid for o in self._tickets.values())
            if len(self._tickets) >= MAX_TICKETS or mine >= MAX_TICKETS_PER_PROCESS:
                raise ResourceExhausted(f"{mine} handovers of this process ({len(self._tickets)} "
                                        "in all) wait for their registration: register the "
                                        "buffers handed over first")
            self._tickets[ticket] = _Offered(mapping, pid)
        return ticket

    def _expire(self) -> None:
        """Forget tickets nobody redeemed in time (their mappings go with them)."""
        now = time.monotonic()
        for ticket in [t for t, o in self._tickets.items() if now - o.since > TICKET_SECONDS]:
            del self._tickets[ticket]

    @staticmethod
    def _answer(conn: socket.socket, reply: bytes) -> None:
        try:
            conn.sendall(reply)
        except OSError:
            pass  # the worker is gone: it will not register
