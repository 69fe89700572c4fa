"""Cross-process stream waits when one process dies with its signal still queued (GPU).

Two bare processes stand for a worker (W) and the daemon (D). W queues GPU_SECONDS of GPU
work, then its ready signal; D's stream waits on that signal, writes 64 MiB into W's
memory, then its done signal; W's stream waits on that. Then one of them is SIGKILLed
(or none: the control, which must wait the whole GPU_SECONDS). The survivor polls its
stream for `--release-after` seconds, then writes the signal itself on a stream of its
own and polls again. A signal is an interprocess CUDA event (`event`) or a 32-bit word
in W's memory (`word`: cuStreamWaitValue32 / cuStreamWriteValue32, tiercache/signals.py).

    python -m benchmarks.process_death [CASE ...] [--release-after S] [--words torch|malloc]

CASE is SIGNAL:WHO, WHO one of none, daemon, worker; by default all five cases. `--words
malloc` puts the words in a small cudaMalloc of their own, as tiercache's client does;
`torch` in a 2 MiB tensor. On an H100 (RESULTS.md, sixteenth round of issue 15), with
torch words and release after 24 s: an event left the survivor waiting for good; a word
released it at once. Every call is made once before the GPU work is queued: a first
launch loads its kernel, which waits until the GPU is idle.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import torch

from tests.gpu.gpu_worker import sleep_gpu
from tiercache import cuda_ipc
from tiercache.signals import own_stream, wait_value, write_value

GPU_SECONDS = 12.0
WORDS = 1 << 19


def _watchdog(seconds: float, stage: list[str]) -> None:
    def fire() -> None:
        time.sleep(seconds)
        print(f"WATCHDOG at stage {stage[-1]}", flush=True)
        os._exit(3)
    threading.Thread(target=fire, daemon=True).start()


def _poll(stream: torch.cuda.Stream, seconds: float) -> float | None:
    started = time.time()
    while time.time() - started < seconds:
        if stream.query():
            return time.time() - started
        time.sleep(0.05)
    return None


def _wait_or_release(stream: torch.cuda.Stream, release_after: float, who: str,
                     release) -> float | None:
    """Seconds until `stream` was done, polled for `release_after` s; if it was not, after
    `release(side)` on a stream of tiercache.signals' own, polled for 10 s more."""
    waited = _poll(stream, release_after)
    print(f"{who}: stream done after {waited}", flush=True)
    if waited is None:
        release(own_stream(torch.device("cuda", torch.cuda.current_device())))
        waited = _poll(stream, 10)
        print(f"{who}: stream done {waited} s after the release", flush=True)
    return waited


def _warm(words: torch.Tensor) -> None:
    """Every call of the run once, so that none loads a module behind the GPU work."""
    side = torch.cuda.Stream()
    write_value(side, words.data_ptr() + 64, 1)
    wait_value(side, words.data_ptr() + 64, 1)
    event = torch.cuda.Event(interprocess=True)
    event.record(side)
    torch.cuda.current_stream().wait_event(event)
    words[16:32].fill_(0)
    torch.cuda.synchronize()


def _words(kind: str) -> torch.Tensor:
    if kind == "torch":
        return torch.zeros(WORDS, dtype=torch.int32, device="cuda")
    from cuda.bindings import runtime
    status, address = runtime.cudaMalloc(8 << 10)
    assert int(status) == 0, status
    words = torch.as_tensor(cuda_ipc._DeviceArray(int(address), 8 << 10), device="cuda").view(torch.int32)
    words.zero_()
    return words


def worker(signal_kind: str, dies: str, words_kind: str, release_after: float) -> None:
    stage = ["start"]
    _watchdog(100 + release_after, stage)
    words, data = _words(words_kind), torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    ready, done = torch.cuda.Event(interprocess=True), torch.cuda.Event(interprocess=True)
    w, d = cuda_ipc.export(words), cuda_ipc.export(data)
    main = torch.cuda.current_stream()
    ready.record(main)
    done.record(main)  # recorded once, so that D may record it again
    sleep_gpu(0.01)
    _warm(words)
    data[:16].clone()
    torch.cuda.synchronize()
    print("H", w.handle.hex(), w.offset, d.handle.hex(), d.offset, ready.ipc_handle().hex(),
          done.ipc_handle().hex(), flush=True)
    sys.stdin.readline()  # D opened them
    sleep_gpu(GPU_SECONDS)
    if dies == "worker" and signal_kind == "word":
        write_value(main, words.data_ptr() + 4, 1)
    else:
        ready.record(main)
    print("W recorded", flush=True)
    sys.stdin.readline()  # D queued its side
    if dies == "worker":
        print("W waiting to be killed", flush=True)
        time.sleep(1000)
    if signal_kind == "word":
        wait_value(main, words.data_ptr(), 1)
    else:
        main.wait_event(done)
    seen = data[:16].clone()  # behind the wait
    print("W waiting", flush=True)
    stage.append("waiting")
    sys.stdin.readline()  # the parent killed D, or not
    waited = _wait_or_release(main, release_after, "W", lambda side: write_value(
        side, words.data_ptr(), 1) if signal_kind == "word" else done.record(side))
    if waited is not None:
        print(f"W saw {seen[:4].tolist()}; its GPU works: {torch.ones(8, device='cuda').sum().item()}",
              flush=True)


def daemon(signal_kind: str, dies: str, release_after: float, words_handle: str, words_at: str,
           data_handle: str, data_at: str, ready_handle: str, done_handle: str) -> None:
    stage = ["start"]
    _watchdog(100 + release_after, stage)
    device = torch.cuda.current_device()
    words_base = cuda_ipc.Opened(bytes.fromhex(words_handle), device)
    data_base = cuda_ipc.Opened(bytes.fromhex(data_handle), device)
    words = words_base.address + int(words_at)
    data = data_base.view(int(data_at), 64 << 20)
    ready = torch.cuda.Event.from_ipc_handle(torch.device("cuda", device), bytes.fromhex(ready_handle))
    done = torch.cuda.Event.from_ipc_handle(torch.device("cuda", device), bytes.fromhex(done_handle))
    copies = torch.cuda.Stream()
    scratch = torch.zeros(1 << 10, dtype=torch.int32, device="cuda")
    _warm(scratch)
    with torch.cuda.stream(copies):
        scratch.fill_(7)
        data[:16].fill_(0)
    torch.cuda.synchronize()
    print("D opened", flush=True)
    sys.stdin.readline()  # W queued its work and its ready signal
    with torch.cuda.stream(copies):
        if dies == "worker" and signal_kind == "word":
            wait_value(copies, words + 4, 1)
        else:
            copies.wait_event(ready)
        data.fill_(7)
        if signal_kind == "word" and dies != "worker":
            write_value(copies, words, 1)
        else:
            done.record(copies)
    print("D queued", flush=True)
    if dies != "worker":
        time.sleep(1000)
    sys.stdin.readline()  # W was killed
    waited = _wait_or_release(copies, release_after, "D (W dead)", lambda side: write_value(
        side, words + 4, 1) if signal_kind == "word" else ready.record(side))
    if waited is not None:
        print(f"D wrote {data[:4].tolist()}; its GPU works: {torch.ones(8, device='cuda').sum().item()}",
              flush=True)
        words_base.close()
        data_base.close()
        print("D closed its IPC handles", flush=True)


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "benchmarks.process_death", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _until(process: subprocess.Popen, word: str, tag: str) -> str:
    for line in process.stdout:
        if not line.startswith("H "):
            print(f"  [{tag}] {line.rstrip()}", flush=True)
        if line.startswith(word):
            return line
    raise RuntimeError(f"{tag} ended before {word!r}")


def _say(process: subprocess.Popen, line: str = "go") -> None:
    process.stdin.write(line + "\n")
    process.stdin.flush()


def _rest(process: subprocess.Popen, tag: str, timeout: float) -> None:
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out = process.communicate()[0] + "\n(killed: it ran past the case's time)"
    for line in out.splitlines():
        print(f"  [{tag}] {line}", flush=True)


def case(signal_kind: str, dies: str, words_kind: str, release_after: float) -> None:
    print(f"== {signal_kind} signal, killed: {dies}, words: {words_kind}, release after "
          f"{release_after} s", flush=True)
    w = _spawn("w", signal_kind, dies, words_kind, str(release_after))
    handles = _until(w, "H ", "W").split()[1:]
    d = _spawn("d", signal_kind, dies, str(release_after), *handles)
    _until(d, "D opened", "D")
    _say(w)
    _until(w, "W recorded", "W")
    started = time.time()
    _say(d)
    _until(d, "D queued", "D")
    _say(w)
    if dies == "worker":
        _until(w, "W waiting to be killed", "W")
        w.send_signal(signal.SIGKILL)
        w.wait()
        print(f"  W killed {time.time() - started:.2f} s after D's side was queued", flush=True)
        _say(d)
        _rest(d, "D", release_after + 60)
        return
    _until(w, "W waiting", "W")
    if dies == "daemon":
        d.send_signal(signal.SIGKILL)
        d.wait()
        print(f"  D killed {time.time() - started:.2f} s after its side was queued", flush=True)
    _say(w)
    _rest(w, "W", release_after + 60)
    if d.poll() is None:
        d.kill()
        d.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", default=["word:none", "event:daemon", "event:worker",
                                                     "word:daemon", "word:worker"])
    parser.add_argument("--release-after", type=float, default=2 * GPU_SECONDS)
    parser.add_argument("--words", choices=("torch", "malloc"), default="torch")
    args = parser.parse_args()
    for spec in args.cases:
        signal_kind, dies = spec.split(":")
        case(signal_kind, dies, args.words, args.release_after)


if __name__ == "__main__":
    if sys.argv[1:2] == ["w"]:
        worker(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
    elif sys.argv[1:2] == ["d"]:
        daemon(sys.argv[2], sys.argv[3], float(sys.argv[4]), *sys.argv[5:])
    else:
        main()
