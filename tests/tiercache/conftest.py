"""Every engine test checks the engine's books after each call it makes (tiercache.invariants):
a scenario that passes while leaving them wrong still fails. A test that calls the engine
from several threads at once marks itself `concurrent`: the books are checked at its end."""

from __future__ import annotations

import functools
import threading

import pytest

from tiercache import invariants
from tiercache.engine import Engine

CHECKED = ("store", "store_pages", "store_checkpoint", "load", "match", "prefetch", "evict",
           "flush")


def pytest_configure(config):
    config.addinivalue_line("markers", "concurrent: calls the engine from several threads at once")


def _checked(method, busy: threading.local):
    @functools.wraps(method)
    def call(engine, *args, **kwargs):
        outermost = not getattr(busy, "depth", 0)
        busy.depth = getattr(busy, "depth", 0) + 1
        try:
            result = method(engine, *args, **kwargs)
        finally:
            busy.depth -= 1
        if outermost and not engine.books.closing:
            wrong = invariants.violations(engine)
            assert not wrong, f"after {method.__name__}: {wrong}"
        return result
    return call


@pytest.fixture(autouse=True)
def books_balance(request, monkeypatch):
    if request.node.get_closest_marker("concurrent"):
        yield
        return
    busy = threading.local()
    for name in CHECKED:
        monkeypatch.setattr(Engine, name, _checked(getattr(Engine, name), busy))
    yield
