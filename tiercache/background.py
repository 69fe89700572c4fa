"""One thread that takes work off the request path.

The engine kicks it after anything that may have made work (a store to write through, a
host filling up, a match that asked for a promotion); the thread then calls `step` until
it reports that nothing is left. `drain` is the barrier tests and `flush` use: it returns
once every kick so far has been worked off, and re-raises what a step raised meanwhile.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("tiercache.background")


class Background:
    def __init__(self, step: Callable[[], bool], name: str) -> None:
        self._step = step
        self._name = name
        self._cond = threading.Condition()
        self._kicked = False
        self._busy = False
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def kick(self) -> None:
        """There may be work: run `step` until it finds none."""
        with self._cond:
            self._kicked = True
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until the work of every kick so far is done; raise the last step's error."""
        with self._cond:
            while self._kicked or self._busy:
                self._cond.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def stop(self) -> None:
        """Finish the work kicked so far, then end the thread and join it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._kicked and not self._stopping:
                    self._cond.wait()
                if not self._kicked:
                    return
                self._kicked, self._busy = False, True
            try:
                while self._step():
                    pass
            except BaseException as error:  # kept for drain(): the thread must live on
                log.exception("%s: a background step failed (its work stays undone)", self._name)
                with self._cond:
                    self._error = error
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
