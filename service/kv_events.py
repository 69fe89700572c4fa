"""KV events for routers: what the cache holds, published as vLLM publishes it.

A ZMQ PUB socket sends each batch as three frames: the topic `kv@<pod>@<model>`, an
8-byte big-endian sequence number, and the msgpack batch (kv_encoding.py). A ROUTER
socket answers replay requests (an 8-byte big-endian start sequence) with every
buffered batch from there on, `[seq, payload]` each, and ends with sequence -1 and an
empty payload, as vLLM's ZmqEventPublisher does. Entries of the shared remote tier are
published under a pseudo pod of their own (`remote_pod`), which every daemon sharing
the cluster uses, as llm-d's own shared-storage backends do.

One thread owns both sockets: it takes the cache's changes every `interval` seconds
(tiercache.events: recording them costs the cache an append), encodes and sends them.
Everything is bounded: changes waiting (the event log), batches kept for replay (count
and bytes) and messages queued for each subscriber (ZMQ's high-water mark, past which
PUB drops). A dropped change means routers hold a stale view, so the next batch of
every model starts with AllBlocksCleared: a router then forgets what it knew of this
cache and learns again from new stores.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from tiercache_service import kv_encoding
from tiercache.errors import InvalidArgument
from tiercache.events import REMOTE_MEDIUM, EventLog

log = logging.getLogger("tiercache.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MiB = 1 << 20


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str  # PUB: tcp://*:5557 binds; subscribers connect
    replay_endpoint: str = ""  # ROUTER for replay requests ("" = none)
    pod: str = ""  # the topic's pod part; "" = <hostname>:<endpoint's port>
    remote_pod: str = "tiercache-remote"  # the pseudo pod of the shared remote tier
    replay_batches: int = 10_000
    replay_bytes: int = 64 * MiB
    hwm: int = 10_000  # messages queued per subscriber before PUB drops
    interval: float = 0.02  # seconds between batches
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise InvalidArgument(f"kv_events {name}={value!r}: write e.g. tcp://*:5557")
        if not self.endpoint:
            raise InvalidArgument("kv_events needs an endpoint, e.g. tcp://*:5557")

    def topic_pod(self) -> str:
        return self.pod or f"{socket.gethostname()}:{self.endpoint.rsplit(':', 1)[-1]}"


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig, events: EventLog) -> None:
        self.config = config
        self.events = events
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._replay: deque[tuple[int, bytes]] = deque()
        self._replay_bytes = 0
        self.sequence = 0  # the next batch's
        self.replays = 0

    def start(self) -> "KvEventPublisher":
        """Bind the sockets (on the publishing thread) and start publishing; raises if a
        socket cannot bind."""
        self._thread = threading.Thread(target=self._run, name="tiercache-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        """Publish what is left, then close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        context = zmq.Context.instance()
        pub, router = context.socket(zmq.PUB), None
        try:
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(self.config.endpoint)
            if self.config.replay_endpoint:
                router = context.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(self.config.replay_endpoint)
        except zmq.ZMQError as error:
            self._error = InvalidArgument(f"kv_events cannot bind: {error}: is the port taken?")
            pub.close()
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        if router is not None:
            poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self._wait(router, poller)
                self._publish(pub)
            self._publish(pub)
        finally:
            pub.close()
            if router is not None:
                router.close()

    def _wait(self, router: zmq.Socket | None, poller: zmq.Poller) -> None:
        """Wait one interval, answering replay requests meanwhile."""
        if router is None:
            self._stop.wait(self.config.interval)
            return
        deadline = time.monotonic() + self.config.interval
        while (left := deadline - time.monotonic()) > 0 and poller.poll(left * 1000):
            self._answer(router)

    def _publish(self, pub: zmq.Socket) -> None:
        taken = self.events.take()
        by_topic: dict[str, list[dict]] = {}
        if taken.lost:
            log.warning("kv events: the cache changed faster than they could be published; "
                        "routers are told to forget this cache (AllBlocksCleared)")
            for model in self.events.models():
                by_topic.setdefault(self._topic(model, False), []).append(kv_encoding.cleared())
        for blocks in taken.events:
            topic = self._topic(blocks.model, blocks.medium == REMOTE_MEDIUM)
            by_topic.setdefault(topic, []).append(kv_encoding.event(blocks))
        for topic, events in by_topic.items():
            self._send(pub, topic, kv_encoding.batch(events, self.config.data_parallel_rank))
        self.events.batches += len(by_topic)

    def _topic(self, model: str, remote: bool) -> str:
        pod = self.config.remote_pod if remote else self.config.topic_pod()
        return f"kv@{pod}@{model}"

    def _send(self, pub: zmq.Socket, topic: str, payload: bytes) -> None:
        seq = self.sequence
        self.sequence += 1
        try:  # PUB never blocks: past a subscriber's high-water mark, ZMQ drops for it
            pub.send_multipart((topic.encode(), seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            pass
        self._replay.append((seq, payload))
        self._replay_bytes += len(payload)
        while self._replay and (len(self._replay) > self.config.replay_batches
                                or self._replay_bytes > self.config.replay_bytes):
            self._replay_bytes -= len(self._replay.popleft()[1])

    def _answer(self, router: zmq.Socket) -> None:
        """A replay request: [identity, b"", start sequence]; anything else is ignored."""
        frames = router.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a malformed replay request (%d frames) was ignored", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        self.replays += 1
        for seq, payload in list(self._replay):
            if seq >= start:
                router.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        router.send_multipart((identity, b"", END_SEQ, b""))


def publisher_for(config: KvEventsConfig | None, events: EventLog) -> KvEventPublisher | None:
    return None if config is None else KvEventPublisher(config, events).start()

