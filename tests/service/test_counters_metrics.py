"""Every counter the engine keeps has a metric: a counter nobody can watch hides defects
(copied_down once had none, and was not counted on one path)."""

from __future__ import annotations

import re

from tiercache_service.metrics import _LABELLED, _PLAIN, _SUMMED
from tiercache.counters import Counters


def test_every_counter_has_a_metric():
    served = set(_PLAIN.values()) | set(_SUMMED) | {
        key for keys in _LABELLED.values() for key in keys.values()}
    missing = sorted(set(Counters().flat()) - served)
    assert not missing, f"counters without a metric: {missing} (map them in service/metrics.py)"


def test_counter_names_are_plain_words():
    assert all(re.fullmatch(r"[a-z_]+", name) for name in Counters().flat())
