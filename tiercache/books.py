"""The books: which tiers hold which entries, which slots are whose, what may be evicted,
and the one lock that guards them all. Nothing else takes the lock, and nothing here
moves bytes or touches the disk: the paths (store.py, load.py, promotions.py,
background.py) prepare here, copy outside the lock, and complete here, in the manner of
vLLM's OffloadingManager.

An eviction that must move what it evicts (a host entry not on disk yet, a device entry
without a host copy, a disk entry whose LMDB records must go) does not do that here: it
pins the victims and returns them as `Displaced` (room.py), which the caller settles
outside the lock (background.Mover.settle) and completes with `complete_displaced`.
Until then the victims keep their slots, so a reservation may come back short, with the
displaced work that will free room: the caller settles it and asks again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from tiercache.arrays import distinct
from tiercache.counters import Counters, EvictReason
from tiercache.errors import FailedPrecondition
from tiercache.hashing import PageKey, key_list
from tiercache.index import ANY_TIER, Hit, Index
from tiercache.joint import JointHit, Member, joint_hit
from tiercache.layout import Layout
from tiercache.metrics import byte_counters
from tiercache.policy import EvictionPolicy, FlopAware
from tiercache.results import EngineStats, Kind, Match, Tier, TierStats
from tiercache.room import DiskBatch, Displaced, DownBatch, Room
from tiercache.tiers.arena import SlotArena
from tiercache.tiers.disk import DiskTier
from tiercache.tuning import AlphaTuner


@dataclass(frozen=True)
class Claim:
    """What a store may write: positions of the keys nobody holds or writes (`todo`) and
    the index rows claimed for them (`rows`), and positions of keys held by entries of
    another size or check (`clashes`)."""

    todo: np.ndarray
    rows: np.ndarray
    clashes: np.ndarray


class Books:
    def __init__(self, index: Index, host: SlotArena, disk: DiskTier | None,
                 policy: EvictionPolicy, evict_slack: float, tuner: AlphaTuner | None = None) -> None:
        self.lock = threading.RLock()
        self.index = index
        self.host = host
        self.disk = disk
        self.counters = Counters()
        self.room = Room(index, host, disk, policy, evict_slack, self.counters, tuner)
        self.closing = False
        self._claimed = 0  # index rows stores have claimed and not yet published or released

    @property
    def device(self) -> SlotArena | None:
        return self.room.device

    def attach_device(self, arena: SlotArena) -> None:
        """The device tier, on the GPU the first GPU worker brought."""
        with self.lock:
            self.room.device = arena

    def arena(self, tier: Tier) -> SlotArena:
        return self.room.arena(tier)

    def check_open(self) -> None:
        if self.closing:
            raise FailedPrecondition("the engine is closed: open a new one with Engine.open")

    # -- lookups --------------------------------------------------------------------------
    def match(self, layout: Layout, keys: np.ndarray, checks: np.ndarray | None = None,
              pin: bool = False, readable: int = ANY_TIER) -> Hit:
        """The longest hybrid match of entries in the tiers `readable` to the caller (a bit
        mask of Tier), its entries marked used (and pinned, if asked and any)."""
        with self.lock:
            self.check_open()
            self.index.tick()
            hit = self.index.match(keys, layout.page_tokens, layout.page_bytes,
                                   layout.checkpoint_bytes, checks, readable)
            self.index.touch(hit.rows)
            if pin and hit.match.pages:
                self.index.pin(hit.rows)
            return hit

    def match_group(self, members: list[Member], page_tokens: int,
                    checks: np.ndarray | None) -> JointHit:
        """The longest prefix every member of a group can load, its entries marked used."""
        with self.lock:
            self.check_open()
            self.index.tick()
            hit = joint_hit(self.index, members, page_tokens, checks)
            self.index.touch(hit.rows)
            return hit

    def held(self, keys: np.ndarray, page_bytes: int, checkpoint_bytes: int,
             checks: np.ndarray | None) -> tuple[np.ndarray, ...]:
        with self.lock:
            return self.index.held(keys, page_bytes, checkpoint_bytes, checks)

    def adopt(self, kind: Kind, keys: np.ndarray, depths: np.ndarray, nbytes: int,
              slots: np.ndarray, filled: np.ndarray, checks: np.ndarray) -> np.ndarray:
        """Publish entries brought into host `slots` from elsewhere (those `filled`; the
        others' slots, and those of entries the host holds by now, are freed), pinned;
        returns their rows."""
        with self.lock:
            rows = self.index.rows_of(kind, keys)
            # held in the host by now, or claimed by a store writing it: not ours to publish
            there = (rows >= 0) & (self.index.in_tier(np.maximum(rows, 0), Tier.HOST)
                                   | (self.index.column("tiers", np.maximum(rows, 0)) == 0))
            self.host.free(nbytes, slots[~filled].tolist() + slots[filled][there].tolist())
            keep = ~there
            if not keep.any():
                return np.empty(0, np.int64)
            published = self.index.publish(kind, keys[keep], depths[keep], nbytes, Tier.HOST,
                                           slots[filled][keep], checks=checks[keep])
            self.index.pin(published)
            return published

    def pin_in_host(self, kind: Kind, keys: np.ndarray) -> tuple[np.ndarray, list]:
        """Pin the entries under `keys` that the host holds; their rows, and for each its
        key, depth, host bytes (a view, valid while pinned) and check."""
        with self.lock:
            rows = self.index.rows_of(kind, keys)
            rows = rows[rows >= 0]
            rows = rows[self.index.in_tier(rows, Tier.HOST)]
            self.index.pin(rows)
            index = self.index
            held = [(key, depth, self.host.pool(size).view(slot), check) for key, depth, size, slot, check
                    in zip(key_list(index.keys(rows)), index.column("depth", rows).tolist(),
                           index.column("nbytes", rows).tolist(), index.slots(rows, Tier.HOST).tolist(),
                           index.column("check", rows).tolist())]
            return rows, held

    def observe(self, observer) -> None:
        """Tell `observer` (entered, kinds, tier, keys) of every entry entering or leaving
        a tier, under the lock (KV events, which only append)."""
        with self.lock:
            self.index.observer = observer

    def rows_of(self, kind: Kind, keys: np.ndarray) -> np.ndarray:
        with self.lock:
            return self.index.rows_of(kind, keys)

    def rows_named(self, keys: np.ndarray) -> np.ndarray:
        """The rows of pages and checkpoints under `keys`."""
        with self.lock:
            found = np.concatenate([self.index.rows_of(kind, keys) for kind in Kind])
            return distinct(found[found >= 0])

    def index_rows(self, tier: Tier) -> np.ndarray:
        with self.lock:
            return self.index.rows_in(tier)

    def count_match(self, match: Match, page_tokens: int) -> None:
        with self.lock:
            self.counters.count_match(match, page_tokens)

    def stats(self, traffic: dict) -> EngineStats:
        with self.lock:
            tiers = [TierStats(Tier.HOST, self.index.count[Tier.HOST], self.host.used_bytes,
                               self.host.budget_bytes)]
            if self.device is not None:
                tiers.insert(0, TierStats(Tier.DEVICE, self.index.count[Tier.DEVICE],
                                          self.device.used_bytes, self.device.budget_bytes))
            if self.disk is not None:
                tiers.append(TierStats(Tier.DISK, self.index.count[Tier.DISK], self.disk.used_bytes,
                                       self.disk.budget_bytes))
            counters = {**self.counters.flat(), **byte_counters(traffic),
                        "collisions": self.index.collisions, "foreign_entries": self.index.foreign,
                        "checksum_failures": self.disk.checksum_failures if self.disk else 0,
                        "disk_write_errors": self.disk.write_errors if self.disk else 0,
                        "disk_moved_aside": int(self.disk is not None and self.disk.moved_aside is not None)}
            return EngineStats(tuple(tiers), counters, getattr(self.room.policy, "alpha", None))

    def keys(self, rows: np.ndarray) -> list[PageKey]:
        with self.lock:
            return key_list(self.index.keys(rows))

    def columns(self, rows: np.ndarray, *names: str) -> tuple[np.ndarray, ...]:
        with self.lock:
            return tuple(self.index.column(name, rows) for name in names)

    def count(self, counter: str, n: int) -> None:
        with self.lock:
            setattr(self.counters, counter, getattr(self.counters, counter) + n)

    def locate(self, rows: np.ndarray, device_ok: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(on the device, device slots of those, host slots or -1, positions of those only
        on disk) of pinned entries; the device copies count only for workers on the device
        tier's GPU (`device_ok`)."""
        with self.lock:
            return self.index.locate(rows, device_ok)

    def in_tier(self, rows: np.ndarray, tier: Tier) -> np.ndarray:
        with self.lock:
            return self.index.in_tier(rows, tier)

    def disk_only(self, rows: np.ndarray) -> np.ndarray:
        """Those of `rows` (present entries) in no memory tier: what a promotion moves. An
        entry still only on the device, not yet copied down, is on no disk."""
        with self.lock:
            return rows[~self.index.in_tier(rows, Tier.HOST | Tier.DEVICE)]

    def cached_pages(self, chain: np.ndarray) -> int:
        """How many leading pages of the chain are cached, in any tier."""
        with self.lock:
            self.check_open()
            rows = self.index.rows_of(Kind.PAGE, chain)
            missing = np.flatnonzero((rows < 0) | (self.index.column("tiers", np.maximum(rows, 0)) == 0))
            return int(missing[0]) if len(missing) else len(chain)

    def holds_any(self, kind: Kind, keys: np.ndarray) -> bool:
        """Whether any of `keys` has an index row: cached, or claimed by a store."""
        with self.lock:
            return bool((self.index.rows_of(kind, keys) >= 0).any())

    def stamp(self, chain: np.ndarray, checkpoints: bool) -> tuple[int, np.ndarray]:
        """A stamp for a store and the checkpoint rows of its chain (-1 where none)."""
        with self.lock:
            self.check_open()
            found = self.index.rows_of(Kind.CHECKPOINT, chain) if checkpoints else np.empty(0, np.int64)
            found[(found >= 0) & (self.index.column("tiers", np.maximum(found, 0)) == 0)] = -1
            return self.index.tick(), found

    # -- pins and values ------------------------------------------------------------------
    def pin(self, rows: np.ndarray) -> None:
        with self.lock:
            self.index.pin(rows)

    def unpin(self, rows: np.ndarray) -> None:
        with self.lock:
            self.index.unpin(rows)

    def raise_values(self, kind: Kind, keys: np.ndarray, values: np.ndarray) -> None:
        with self.lock:
            rows = self.index.rows_of(kind, keys)
            self.index.raise_values(rows[rows >= 0], values[rows >= 0])

    # -- storing --------------------------------------------------------------------------
    def claim(self, kind: Kind, keys: np.ndarray, depths: np.ndarray, nbytes: int,
              values: np.ndarray, stamp: int, checks: np.ndarray | None, shared: bool,
              pins: list[np.ndarray] | None) -> Claim:
        """Refresh the entries already cached (pinning them for a durable store); claim
        index rows for the others that no concurrent store is writing (index.claim)."""
        with self.lock:
            self.check_open()
            index = self.index
            rows = index.rows_of(kind, keys)
            live = rows >= 0
            live[live] = index.column("tiers", rows[live]) != 0  # claimed: another store's
            # an entry of another size or check under the key is not this caller's to use
            usable = index.usable(np.where(live, rows, -1), nbytes, checks)
            clashes = np.flatnonzero(live & (usable < 0))
            present = rows[live & (usable >= 0)]
            index.touch(present, stamp)
            index.raise_values(present, values[live & (usable >= 0)])
            if pins is not None:
                index.pin(present)
                pins.append(present)
            todo = np.flatnonzero(rows < 0)
            tuner = self.room.tuner
            if tuner is not None:
                alpha = tuner.alpha
                self.counters.regrets += tuner.returned(kind, keys[todo])
                if tuner.alpha != alpha:
                    self.room.policy = FlopAware(tuner.alpha)
            claimed = index.claim(kind, keys[todo], depths[todo], nbytes,
                                  None if checks is None else checks[todo])
            index.raise_values(claimed, values[todo])
            if shared:
                index.share(claimed)
            self._claimed += len(claimed)
            return Claim(todo, claimed, clashes)

    def unclaim(self, kind: Kind, claim: Claim, stored: int, skipped: int) -> None:
        """A store is done with its claim, of which it published the first `stored` rows
        (those may be gone again by now, evicted: not the claim's any more); the rest
        leave the index."""
        with self.lock:
            self.index.release(claim.rows[stored:])
            self._claimed -= len(claim.rows)
            if kind == Kind.PAGE:
                self.counters.stored_pages += stored
                self.counters.skipped_pages += skipped
            else:
                self.counters.stored_checkpoints += stored
                self.counters.skipped_checkpoints += skipped

    def storing(self) -> bool:
        """Whether a store is writing entries now."""
        with self.lock:
            return self._claimed > 0

    def reserve(self, nbytes: int, count: int, tier: Tier) -> tuple[list[int], Displaced]:
        """Up to `count` slots of `nbytes` in an arena tier, evicting cold entries for room.
        Victims that must move first are returned as displaced work instead (see above)."""
        with self.lock:
            self.check_open()
            displaced = Displaced()
            slots = self.room.reserve(nbytes, count, tier, displaced, clean_only=False)
            return slots, displaced

    def reserve_clean(self, nbytes: int, count: int) -> list[int]:
        """Up to `count` host slots, evicting only entries that need no move first."""
        with self.lock:
            self.check_open()
            return self.room.reserve(nbytes, count, Tier.HOST, Displaced(), clean_only=True)

    def settle_promotion(self, pinned: np.ndarray | None,
                         placed: list[tuple[np.ndarray, list[int], int, list[int] | None]],
                         complete: bool) -> int:
        """Publish promoted entries read whole (if `complete`), free the other slots, unpin
        `pinned`; returns how many were published."""
        published = 0
        with self.lock:
            if pinned is not None:
                self.index.unpin(pinned)
            for rows, slots, nbytes, bad in placed:
                good = np.zeros(len(rows), bool) if bad is None or not complete else ~np.isin(rows, bad)
                slots = np.asarray(slots, np.int64)
                self.host.free(nbytes, slots[~good].tolist())
                self.index.add_tier(rows[good], Tier.HOST, slots[good])
                published += int(good.sum())
            self.counters.promoted += published
        return published

    def free(self, nbytes: int, slots: list[int], tier: Tier) -> None:
        with self.lock:
            self.arena(tier).free(nbytes, slots)

    def publish_claimed(self, rows: np.ndarray, tier: Tier, slots: list[int], stamp: int,
                        pin: bool = False) -> None:
        """Make claimed rows visible in `tier` once their bytes are all there (invariant 1)."""
        with self.lock:
            self.index.add_tier(rows, tier, slots, stamp)
            if pin:
                self.index.pin(rows)

    def publish(self, kind: Kind, keys: np.ndarray, depths: np.ndarray, nbytes: int, tier: Tier,
                slots: list[int] | None, stamp: int | None = None, values: np.ndarray | None = None,
                checks: np.ndarray | None = None, pin: bool = False) -> np.ndarray:
        """Make entries visible in `tier` once their bytes are all there (invariant 1)."""
        with self.lock:
            rows = self.index.publish(kind, keys, depths, nbytes, tier, slots, stamp, values, checks)
            if pin:
                self.index.pin(rows)
            return rows

    def add_tier(self, rows: np.ndarray, tier: Tier, slots: list[int] | np.ndarray | None) -> None:
        with self.lock:
            self.index.add_tier(rows, tier, slots)

    # -- eviction -------------------------------------------------------------------------
    def complete_displaced(self, displaced: Displaced, demoted: bool, copied: bool) -> int:
        """After the displaced work was done (or failed): see Room.complete."""
        with self.lock:
            return self.room.complete(displaced, demoted, copied)

    def deleted(self, entries: list[tuple[Kind, PageKey]]) -> None:
        """LMDB records of evicted entries are gone: their keys may be written again."""
        with self.lock:
            for kind, key in entries:
                self.room.deleting.pop(bytes((kind,)) + key, None)

    def drop(self, rows: np.ndarray) -> Displaced:
        """Remove damaged entries from every tier. One a load is still reading stays:
        that load finds out for itself and drops it when it ends."""
        displaced = Displaced()
        with self.lock:
            rows = rows[self.index.column("pins", rows) == 0]
            for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
                inside = rows[self.index.in_tier(rows, tier)]
                if len(inside):
                    self.room.remove(inside, tier, displaced)
                    self.counters.evicted[tier, EvictReason.DAMAGED] += len(inside)
        return displaced

    def evict(self, rows: np.ndarray | None, tiers: list[Tier]) -> tuple[int, Displaced]:
        """Drop `rows` (every entry if None) from `tiers`; entries a load is reading stay.
        Evicting from the device tier alone moves entries down: those without a host copy
        are displaced to be copied first. Returns (entries dropped, displaced work)."""
        displaced = Displaced()
        with self.lock:
            self.check_open()
            if rows is None:
                rows = distinct(np.concatenate([self.index.rows_in(t) for t in tiers]))
            rows = rows[self.index.column("pins", rows) == 0]
            dropped = np.zeros(len(rows), bool)
            for tier in tiers:
                inside = self.index.in_tier(rows, tier)
                dropped |= inside
                victims = rows[inside]
                if tiers == [Tier.DEVICE] and len(victims):
                    moving = self.room.must_move(victims, Tier.DEVICE)
                    displaced.down = self.room.begin_copy_down(victims[moving], displaced)
                    victims = victims[~moving]
                self.room.remove(victims, tier, displaced)
                self.counters.evicted[tier, EvictReason.REQUEST] += int(inside.sum())
            return int(dropped.sum()), displaced

    # -- host -> disk ---------------------------------------------------------------------
    def dirty(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Of `rows` (every row if None), those in the host and not on disk yet."""
        with self.lock:
            rows = self.index.rows_in(Tier.HOST) if rows is None else rows
            return rows[self.index.in_tier(rows, Tier.HOST) & ~self.index.in_tier(rows, Tier.DISK)]

    def coldest_dirty(self, share: float, limit: int) -> np.ndarray:
        """Write-back: the dirty ones among the coldest `share` of the host budget."""
        with self.lock:
            candidates = self.index.candidates(Tier.HOST)
            order = self.room.policy.order(candidates)
            sizes = np.cumsum(candidates.nbytes[order])
            coldest = candidates.rows[order][:int(np.searchsorted(sizes, share * self.host.budget_bytes)) + 1]
            return self.dirty(coldest)[:limit]

    def begin_write(self, rows: np.ndarray, limit: int) -> tuple[DiskBatch | None, Displaced]:
        """Pin up to `limit` of the dirty `rows`, make room on disk (the evicted disk
        entries come back as displaced deletes) and take what a write needs."""
        displaced = Displaced()
        with self.lock:
            return self.room.begin_write(rows, limit, displaced), displaced

    def make_disk_room(self, nbytes: int) -> Displaced:
        """LMDB needs more room than the budget says: evict at least `nbytes` more."""
        displaced = Displaced()
        with self.lock:
            self.room.evict(Tier.DISK, nbytes, displaced, clean_only=False)
        return displaced

    def end_write(self, batch: DiskBatch, written: bool) -> None:
        with self.lock:
            self.counters.disk_writes += self.room.end_write(batch, written)

    # -- device -> host -------------------------------------------------------------------
    def begin_copy_down(self, rows: np.ndarray) -> DownBatch | None:
        with self.lock:
            rows = distinct(rows)
            rows = rows[self.index.in_tier(rows, Tier.DEVICE) & self.room.must_move(rows, Tier.DEVICE)]
            return self.room.begin_copy_down(rows, Displaced())

    def end_copy_down(self, batch: DownBatch, copied: bool) -> None:
        with self.lock:
            self.counters.copied_down += self.room.end_copy_down(batch, copied)

