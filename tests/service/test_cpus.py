"""The daemon's CPUs (`cpus`, `spin`): a real daemon process, its threads read from /proc."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

import pytest

from tests.service.daemon import running_daemon
from tiercache.client import Client
from tiercache.errors import InvalidArgument
from tiercache.layout import BufferSpec, Layout
from tiercache_service import cpus
from tiercache_service.config import ServiceConfig

SCHED_IDLE = 5
ALLOWED = sorted(os.sched_getaffinity(0))


def threads(pid: int) -> dict[int, tuple[frozenset[int], int]]:
    """Each thread of a process: the CPUs it may run on and its scheduling policy."""
    found = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{task}/stat").read().rsplit(")", 1)[1].split()
            found[int(task)] = (frozenset(os.sched_getaffinity(int(task))), int(stat[38]))
        except (FileNotFoundError, ProcessLookupError):  # a thread that has just ended
            pass
    return found


def cpu_seconds(pid: int, tid: int) -> float:
    """The CPU time thread `tid` of process `pid` has used."""
    stat = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


FIRST, LAST = ALLOWED[0], ALLOWED[-1]
OUTSIDE = next(cpu for cpu in itertools.count(FIRST) if cpu not in ALLOWED)  # the first after FIRST
LISTS = [(f"{FIRST}", {FIRST}), (f"{FIRST}-{FIRST}", {FIRST}), (f" {FIRST} ", {FIRST}),
         (f"{FIRST},{LAST}", {FIRST, LAST})]
if ALLOWED == list(range(FIRST, LAST + 1)):
    LISTS.append((f"{FIRST}-{LAST}", set(ALLOWED)))


@pytest.mark.parametrize("text, expected", LISTS)
def test_cpu_lists_read_as_taskset_writes_them(text, expected):
    assert cpus.parse(text) == expected


@pytest.mark.parametrize("text, said", [
    ("a", "'a' is not a CPU or a range of them: write e.g. 0-3,8"),
    ("3-1", "'3-1' is not a CPU or a range of them"),
    ("0-", "'0-' is not a CPU or a range of them"),
    ("-1", "'-1' is not a CPU or a range of them"),
    (f"{FIRST},,{FIRST}", "'' is not a CPU or a range of them"),
    (f"{FIRST}-{10**12}", f"CPU {OUTSIDE} is not one this process may run on"),
    (f"{LAST + 1}", f"CPU {LAST + 1} is not one this process may run on")])
def test_a_bad_cpu_list_says_what_to_write(text, said):
    with pytest.raises(InvalidArgument, match=said.replace("(", r"\(").replace(")", r"\)")):
        cpus.parse(text)


def test_spin_without_cpus_is_refused_at_once():
    with pytest.raises(InvalidArgument, match="spin needs cpus: name the CPUs to keep out of idle"):
        ServiceConfig(spin=True).check()
    ServiceConfig(spin=True, cpus=f"{FIRST}").check()


def test_a_daemon_with_cpus_it_may_not_use_does_not_start(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tiercache_service.cli", "serve", "--data-dir",
                           str(tmp_path), "--metrics-address", "", "--cpus", f"{LAST + 1}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"CPU {LAST + 1} is not one this process may run on" in done.stderr + done.stdout


def test_the_daemons_threads_run_on_its_cpus_and_spinners_keep_them_busy(tmp_path):
    cpu = LAST
    layout = Layout(16, paged=(BufferSpec("kv", 8, (16, 8), "bfloat16"),))
    with running_daemon(tmp_path, "--cpus", str(cpu), "--spin") as (address, process):
        worker = Client(address).register("m", layout)  # every kind of thread has started
        keys = worker.keys(list(range(64)))
        assert worker.store(keys=keys, kv_rows=range(4)).stored == 4
        assert worker.match(keys=keys).pages == 4
        found = threads(process.pid)
        assert all(on == {cpu} for on, _ in found.values()), found
        spinning = [tid for tid, (_, policy) in found.items() if policy == SCHED_IDLE]
        assert len(spinning) == 1, found  # one busy thread, at the lowest priority
        # it runs whenever the CPU has nothing else to run: on an idle daemon, it adds up
        before, deadline = cpu_seconds(process.pid, spinning[0]), time.monotonic() + 30
        while cpu_seconds(process.pid, spinning[0]) - before < 0.5:
            assert time.monotonic() < deadline, "the spinner used under 0.5 s of CPU in 30 s"
            time.sleep(0.1)
        worker.close()
        process.terminate()
        assert process.wait(timeout=30) == 0  # the spinner stops with it


def test_without_cpus_the_daemon_runs_where_it_was_started_and_nothing_spins(tmp_path):
    with running_daemon(tmp_path) as (_, process):
        found = threads(process.pid)
        assert all(on == set(ALLOWED) and policy != SCHED_IDLE for on, policy in found.values()), found
