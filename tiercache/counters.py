"""What the engine counts, as named fields: every counter has one name, one owner (the
books, under their lock) and one metric (service/metrics.py maps each field; a test
fails when one has none)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import numpy as np

from tiercache.results import TIERS, Match, Tier

_ALL_TIERS = tuple(Tier)  # iterating the enum itself costs microseconds a match
_CODES = max(_ALL_TIERS) + 1


class EvictReason(enum.Enum):
    CAPACITY = ""  # the eviction policy made room
    REQUEST = "_by_request"  # an Evict call
    DAMAGED = "_damaged"  # a checksum failed


def _per_tier() -> dict[Tier, int]:
    return dict.fromkeys(Tier, 0)  # a match may also find pages in the remote tier


@dataclass
class Counters:
    matches: int = 0
    requested_pages: int = 0  # pages Match was asked about
    matched_pages: int = 0
    # matched pages, tokens and checkpoints by the tier each was found in (its best)
    matched_pages_in: dict[Tier, int] = field(default_factory=_per_tier)
    matched_tokens_in: dict[Tier, int] = field(default_factory=_per_tier)
    matched_checkpoints_in: dict[Tier, int] = field(default_factory=_per_tier)
    stored_pages: int = 0
    stored_checkpoints: int = 0
    skipped_pages: int = 0  # no room
    skipped_checkpoints: int = 0
    declined_checkpoints: int = 0  # by the admission policy
    loads: int = 0
    loaded_pages: int = 0
    demoted: int = 0  # host entries written to disk by their own eviction
    disk_writes: int = 0  # host entries the background writer wrote
    copied_down: int = 0  # device entries copied to the host (background or eviction)
    promoted: int = 0
    prefetches: int = 0
    promotion_waits: int = 0
    regrets: int = 0  # evicted entries stored again soon after (FLOP-aware tuning)
    unpublished_stores: int = 0  # stores that replied with copies queued, then failed to publish
    evicted: dict[tuple[Tier, EvictReason], int] = field(
        default_factory=lambda: {(t, r): 0 for t in TIERS for r in EvictReason})

    def count_match(self, match: Match, page_tokens: int) -> None:
        """Pages asked for, and matched pages, tokens and checkpoints by the tier they
        were found in. A layout without paged buffers credits its tokens to the
        checkpoint's tier."""
        self.matches += 1
        self.matched_pages += match.pages
        self.requested_pages += match.prompt_pages
        if match.tier_codes:  # one pass over the codes: prompts run to thousands of pages
            found = np.bincount(np.frombuffer(match.tier_codes, np.uint8), minlength=_CODES).tolist()
            for tier in _ALL_TIERS:
                if found[tier]:
                    self.matched_pages_in[tier] += found[tier]
                    self.matched_tokens_in[tier] += found[tier] * page_tokens
        if match.checkpoint_tier is not None and match.pages:
            self.matched_checkpoints_in[match.checkpoint_tier] += 1
            if not match.tier_codes:
                self.matched_tokens_in[match.checkpoint_tier] += match.tokens

    def flat(self) -> dict[str, int]:
        """Every counter under one flat name ("evicted_host_by_request", "matched_pages_disk"),
        as the Stats RPC and `tiercache stats` show them."""
        out: dict[str, int] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "evicted":
                out.update({f"evicted_{t.name.lower()}{r.value}": n for (t, r), n in value.items()})
            elif isinstance(value, dict):
                stem = f.name.removesuffix("_in")
                out.update({f"{stem}_{t.name.lower()}": n for t, n in value.items()})
            else:
                out[f.name] = value
        return out
