"""Prompt lookups, counted where every path that looks up a prompt meets: the servicer's
Match (a worker's, or a group's for vLLM's scheduler) and Load calls, by call and by model
id. The engine counts what it found and moved; whether a Load follows a Match, and for
which model, only the daemon can see.

What counts, and so what the hit rate means (hit pages / asked pages):

- `match`: a Match. Asked: the full pages of its prompt; hit: the pages it found.
- `load`: a Load that no Match of its prompt came just before (the transformers adapter
  and the demo load directly). Asked: the pages it could take (as many as its kv rows,
  or the whole prompt for a layout without paged buffers); hit: the pages it copied.
- `load_after_match`: a Load that follows a Match: the last page it asks for is where a
  recent Match's hit ended (a worker that matches, then loads rows[:hit.pages]; vLLM's
  ranks loading what the scheduler matched for their group). Its pages were asked once
  already, under the Match, so the hit rate leaves it out: each lookup counts once.

The `model` label is the registration's model id, for the first MAX_MODELS distinct ids;
later ones count under "other", so the number of series stays bounded. No tenant, key or
prompt ever becomes a label.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # `tiercache stats` imports this module for hit_rate: it stays light
    from prometheus_client.core import Metric as Family

CALLS = ("match", "load", "load_after_match")
ASKING_CALLS = ("match", "load")  # the calls the hit rate counts
MAX_MODELS = 32  # distinct model labels; beyond, "other"
OTHER_MODEL = "other"
_REMEMBERED = 4096  # ends of recent Match hits, for telling follow-up loads apart


class Lookups:
    """Lookup calls, pages asked and pages hit, by (call, model); thread-safe."""

    def __init__(self, max_models: int = MAX_MODELS, remembered: int = _REMEMBERED) -> None:
        self.max_models = max_models
        self._remembered = remembered
        self._lock = threading.Lock()
        self._models: set[str] = set()
        self._ends: OrderedDict[bytes, None] = OrderedDict()  # keys where Match hits ended
        self._counts: dict[tuple[str, str], list[int]] = {}  # (call, model) -> [calls, asked, hit]

    def model_label(self, model_id: str) -> str:
        """The model's label: its id while fewer than max_models ids have one, else "other"."""
        with self._lock:
            return self._label(model_id)

    def _label(self, model_id: str) -> str:
        if model_id in self._models:
            return model_id
        if len(self._models) < self.max_models:
            self._models.add(model_id)
            return model_id
        return OTHER_MODEL

    def matched(self, model_id: str, keys: bytes, asked: int, hit: int) -> None:
        """A Match of `asked` pages (the wire keys, 16 bytes each) that found `hit`."""
        with self._lock:
            if hit:
                end = keys[16 * (hit - 1):16 * hit]
                self._ends[end] = None
                self._ends.move_to_end(end)
                while len(self._ends) > self._remembered:
                    self._ends.popitem(last=False)
            self._add("match", model_id, asked, hit)

    def loaded(self, model_id: str, keys: bytes, asked: int, hit: int) -> None:
        """A Load that could take `asked` pages of the prompt `keys` and copied `hit`."""
        with self._lock:
            followed = asked > 0 and keys[16 * (asked - 1):16 * asked] in self._ends
            self._add("load_after_match" if followed else "load", model_id, asked, hit)

    def _add(self, call: str, model_id: str, asked: int, hit: int) -> None:
        counts = self._counts.setdefault((call, self._label(model_id)), [0, 0, 0])
        counts[0] += 1
        counts[1] += asked
        counts[2] += hit

    def snapshot(self) -> dict[tuple[str, str], tuple[int, int, int]]:
        with self._lock:
            return {labels: (calls, asked, hit) for labels, (calls, asked, hit) in self._counts.items()}

    def flat(self) -> dict[str, int]:
        """Totals over models by call ("lookup_pages_load", "lookup_hit_pages_match"), for
        the Stats RPC and `tiercache stats`."""
        out = {f"{name}_{call}": 0 for call in CALLS
               for name in ("lookups", "lookup_pages", "lookup_hit_pages")}
        for (call, _), (calls, asked, hit) in self.snapshot().items():
            out[f"lookups_{call}"] += calls
            out[f"lookup_pages_{call}"] += asked
            out[f"lookup_hit_pages_{call}"] += hit
        return out

    def families(self, lookups: Family, pages: Family, hits: Family, ratio: Family
                 ) -> Iterator[Family]:
        """The metric families (declared in service.metrics), filled in."""
        asked_by_model: dict[str, list[int]] = {}
        for (call, model), (calls, asked, hit) in sorted(self.snapshot().items()):
            lookups.add_metric([call, model], calls)
            pages.add_metric([call, model], asked)
            hits.add_metric([call, model], hit)
            if call in ASKING_CALLS:
                both = asked_by_model.setdefault(model, [0, 0])
                both[0] += asked
                both[1] += hit
        for model, (asked, hit) in sorted(asked_by_model.items()):
            ratio.add_metric([model], hit / asked if asked else 0.0)
        yield from (lookups, pages, hits, ratio)


def hit_rate(counters: dict[str, int]) -> tuple[int, int]:
    """(pages hit, pages asked) over the calls the hit rate counts, from flat counters."""
    return (sum(counters.get(f"lookup_hit_pages_{c}", 0) for c in ASKING_CALLS),
            sum(counters.get(f"lookup_pages_{c}", 0) for c in ASKING_CALLS))

