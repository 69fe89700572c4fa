"""Failures of a shared store's nodes, remembered per node: one log line when an
incident begins and one when it ends, however many calls fail in between, and a node
that just failed to connect is left alone for a while, so that calls meanwhile do not
each wait for it (a miss costs nothing; a connect timeout on every Match would)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from tiercache.tiers.remote.store import Failure

log = logging.getLogger("tiercache.remote")


@dataclass
class _Incident:
    failure: Failure
    since: float
    errors: int = 1
    retry_at: float = 0.0  # connection failures: the node is skipped until then


class Incidents:
    def __init__(self, retry_seconds: float) -> None:
        self.retry_seconds = retry_seconds
        self._lock = threading.Lock()
        self._open: dict[str, _Incident] = {}  # node name -> its incident

    def skip(self, node: str) -> bool:
        """Whether to leave `node` out of a call now (it failed to connect moments ago).
        Once its pause is over, one call tries it again; the others keep skipping."""
        with self._lock:
            incident = self._open.get(node)
            if incident is None or incident.failure is not Failure.CONNECTION:
                return False
            now = time.monotonic()
            if now < incident.retry_at:
                return True
            incident.retry_at = now + self.retry_seconds  # this call probes; others wait
            return False

    def failed(self, node: str, failure: Failure, detail: str) -> None:
        """Record a failure of `node`; the first of an incident is logged."""
        now = time.monotonic()
        with self._lock:
            incident = self._open.get(node)
            if incident is not None and incident.failure is failure:
                incident.errors += 1
                incident.retry_at = now + self.retry_seconds
                return
            self._open[node] = _Incident(failure, now, retry_at=now + self.retry_seconds)
        log.warning("remote tier: node %s: %s (%s); its entries are misses and its writes "
                    "are skipped until it answers again%s", node, failure.value, detail,
                    _ADVICE.get(failure, ""))

    def answered(self, node: str) -> None:
        """`node` answered a call: its incident, if any, is over."""
        with self._lock:
            incident = self._open.pop(node, None) if self._open else None
        if incident is not None:
            log.warning("remote tier: node %s answers again after %.1f s of %s (%d failed "
                        "calls)", node, time.monotonic() - incident.since, incident.failure.value,
                        incident.errors)

    def open_incidents(self) -> dict[str, Failure]:
        with self._lock:
            return {node: incident.failure for node, incident in self._open.items()}


_ADVICE = {
    Failure.OOM: ": set maxmemory-policy allkeys-lru on every node (noeviction refuses writes)",
    Failure.CLUSTER_DOWN: ": with one node down, set cluster-require-full-coverage no so "
                          "that the others keep serving",
    Failure.TIMEOUT: ": raise remote_lookup_seconds / get / put if the network is slow",
}
