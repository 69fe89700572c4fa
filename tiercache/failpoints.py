"""Named points where tests make the code fail on purpose (as etcd's gofail does).

    failpoints.hit("store.before_publish")          # in the code: free when nothing is armed

A point does nothing until it is armed, in this process (`armed`, for tests) or in a
daemon from its environment (read once, at start, by tiercache_service.server.serve):

    TIERCACHE_FAILPOINTS="disk.before_commit=raise(0.1);store.before_publish=kill(0.01)"

Actions: `raise` (an InjectedFault), `kill` (SIGKILL this process: a crash at that exact
point), `sleep(S)` (S seconds), each optionally with a probability: `raise(0.1)`,
`kill(0.01)`, `sleep(2,0.5)`. In-process tests may also arm a callable.

Points (where, and what a failure there must not break):
  store.before_gather    engine: arena slots reserved, the worker's rows not copied yet
  store.before_publish   engine: bytes gathered into arena slots, entries not visible yet
  store.before_persist   engine: a durable store published (and pinned), not yet committed
  disk.before_commit     disk tier: values put in the transaction, not committed
  disk.after_commit      disk tier: committed, not yet published in the index
  disk.read              disk tier: reading one entry (a raise stands for an I/O error)
  load.before_scatter    movement: entries staged in host memory, worker rows not written
  load.before_reply      movement: copies into the worker's rows queued, their event recorded
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from contextlib import contextmanager
from typing import Callable, Iterator

Action = Callable[[str], None]


class InjectedFault(RuntimeError):
    """A failure a failpoint raised on purpose."""


_armed: dict[str, Action] = {}


def hit(name: str) -> None:
    """Fire the action armed at `name`, if any."""
    if _armed:
        action = _armed.get(name)
        if action is not None:
            action(name)


@contextmanager
def armed(name: str, action: Action | str) -> Iterator[None]:
    """Arm one point for the duration of a block (tests, in-process)."""
    previous = _armed.get(name)
    _armed[name] = parse_action(action) if isinstance(action, str) else action
    try:
        yield
    finally:
        if previous is None:
            _armed.pop(name, None)
        else:
            _armed[name] = previous


_ACTION = re.compile(r"(raise|kill|sleep)(?:\(([0-9.]+)(?:,([0-9.]+))?\))?")


def parse_action(text: str) -> Action:
    """`raise`, `kill`, `sleep(S)`, each with an optional probability last."""
    found = _ACTION.fullmatch(text.strip())
    if not found:
        raise ValueError(f"failpoint action {text!r}: use raise, kill or sleep(S), with an "
                         "optional probability, e.g. raise(0.1) or sleep(2,0.5)")
    kind, first, second = found.groups()
    seconds = float(first or 0) if kind == "sleep" else 0.0
    chance = float((second if kind == "sleep" else first) or 1.0)

    def act(name: str) -> None:
        if chance < 1.0 and random.random() >= chance:
            return
        if kind == "raise":
            raise InjectedFault(f"failpoint {name}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(seconds)
    return act


def arm_from(spec: str) -> None:
    """Arm the points of a TIERCACHE_FAILPOINTS value: `name=action;name=action`."""
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, _, action = item.partition("=")
        _armed[name.strip()] = parse_action(action)

