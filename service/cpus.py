"""Where the daemon's threads run (`cpus`), and whether those CPUs are kept out of idle
(`spin`).

A call wakes several of the daemon's threads in turn (grpc's poller, a handler, the copy
threads). Left to the scheduler, each may wake on any of the machine's CPUs, often one
that was idle: on a virtual machine an idle CPU has halted and given its core back to the
host, and waking it, with its caches gone cold, costs more than the work it then does.
Pinned to a few CPUs, the daemon's threads find theirs warm more often. With `spin`, each
of those CPUs also runs a busy thread of the lowest priority (SCHED_IDLE, tiercache/_spin.c)
that any other thread takes the CPU from at once: the CPUs never halt. That costs their
power, all the time: it is off unless asked for.
"""

from __future__ import annotations

import os
import threading

from tiercache._spin import spin
from tiercache.errors import InvalidArgument


def parse(text: str) -> frozenset[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8}. Refuses CPUs this process may not run on."""
    allowed = os.sched_getaffinity(0)
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise InvalidArgument(f"cpus={text!r}: {part.strip()!r} is not a CPU or a range of them: "
                                  "write e.g. 0-3,8")
        named = range(int(first), int(last if dash else first) + 1)
        if named[-1] > max(allowed) or not allowed.issuperset(named):
            wrong = next(cpu for cpu in named if cpu not in allowed)
            raise InvalidArgument(f"cpus={text!r}: CPU {wrong} is not one this process may run on "
                                  f"({_ranges(allowed)}): name some of those")
        cpus.update(named)
    return frozenset(cpus)


def pin(cpus: frozenset[int]) -> None:
    """Every thread of this process, and every thread it starts from now on, runs on `cpus`."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # a thread that has just ended
            pass


class Spinners:
    """One busy thread of the lowest priority on each of `cpus`, until `stop`."""

    def __init__(self, cpus: frozenset[int]) -> None:
        self._on = bytearray(b"\1")
        self._threads = [threading.Thread(target=self._run, args=(cpu,), daemon=True,
                                          name=f"tiercache-spin-{cpu}") for cpu in sorted(cpus)]
        for thread in self._threads:
            thread.start()

    def _run(self, cpu: int) -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only (Linux: 0 is the calling thread)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        spin(self._on)

    def stop(self) -> None:
        self._on[0] = 0
        for thread in self._threads:
            thread.join()


def _ranges(cpus: set[int]) -> str:
    """{0, 1, 2, 3, 8} -> "0-3,8"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
