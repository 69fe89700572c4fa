"""Waiting in tests for what another thread or process does a moment later."""

from __future__ import annotations

import time
from typing import Callable


def eventually(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Whether `condition()` holds within `seconds` (asked every 50 ms, and once more at
    the end)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()
