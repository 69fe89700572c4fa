"""Calls cancelled once past their deadline, by one thread for all of a process's: the
daemon's calls that have not sent their request in time (service/gate.py), a worker's
calls on its stream that got no reply in time (tiercache/call_stream.py)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator


class Deadlines:
    """Cancels each watched call (anything with `cancel()`) once its time is up, looking
    every `every` seconds."""

    def __init__(self, name: str, every: float) -> None:
        self._name, self._every = name, every
        self._calls: dict[int, tuple[float, Any, list[bool]]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watching(self, call: Any, seconds: float) -> Iterator[list[bool]]:
        """While the block runs, `call` is cancelled once `seconds` have passed; the list
        it yields is then [True], and stays so once the block has ended (it is set and the
        call cancelled under the lock the block's end takes)."""
        fired: list[bool] = []
        with self._lock:
            self._calls[id(fired)] = (time.monotonic() + seconds, call, fired)
            if self._thread is None or not self._thread.is_alive():  # also after a fork
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        try:
            yield fired
        finally:
            with self._lock:
                self._calls.pop(id(fired), None)

    def _run(self) -> None:
        while True:
            time.sleep(self._every)
            now = time.monotonic()
            with self._lock:
                late = [key for key, (deadline, _, _) in self._calls.items() if deadline <= now]
                for _, call, fired in [self._calls.pop(key) for key in late]:
                    fired.append(True)
                    call.cancel()
