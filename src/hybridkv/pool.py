"""A fixed pool of page-sized slots for one cacheable group.

Each resident key owns one slot and a reference count: ``-1`` while its bytes are being
written (invisible to loads), ``0`` when stored and evictable, ``> 0`` while pinned by
loads or background copies. Slot ids are local to the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from hybridkv.policies import EvictionPolicy, make_policy

WRITE_PENDING = -1


class Lookup(Enum):
    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"   # being written: ask again next step
    RETRY = "retry"               # a secondary tier has not answered yet


@dataclass
class StorePlan:
    """What ``prepare_store`` reserved: keys to write now, their slots, and keys evicted."""

    keys: list
    slots: list[int]
    evicted: list = field(default_factory=list)


@dataclass
class PoolStats:
    lookups: int = 0
    hits: int = 0
    stores: int = 0
    failed_stores: int = 0
    evictions: int = 0
    store_refusals: int = 0


class SlotPool:
    def __init__(self, group_id: int, capacity: int, policy: str | EvictionPolicy = "lru"):
        if capacity <= 0:
            raise ValueError(f"group {group_id}: a pool needs at least one slot")
        self.group_id = group_id
        self.capacity = capacity
        self.policy = make_policy(policy, capacity) if isinstance(policy, str) else policy
        self._slot: dict = {}      # key -> slot id
        self._refs: dict = {}      # key -> reference count (WRITE_PENDING while written)
        self._free: list[int] = []
        self._fresh = 0            # slots never handed out start here (lazy free list)
        self.stats = PoolStats()
        self.events: list[tuple[str, int, object]] = []

    # -- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key) -> bool:
        return key in self._slot

    def free_count(self) -> int:
        return len(self._free) + self.capacity - self._fresh

    def lookup(self, key) -> Lookup:
        self.stats.lookups += 1
        refs = self._refs.get(key)
        if refs is None:
            return Lookup.MISS
        if refs == WRITE_PENDING:
            return Lookup.HIT_PENDING
        self.stats.hits += 1
        return Lookup.HIT

    def slot_of(self, key) -> int:
        return self._slot[key]

    def refs_of(self, key) -> int | None:
        return self._refs.get(key)

    # -- loads ---------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence) -> list[int]:
        """Pin stored keys and return their slots; raises KeyError for a key not loadable."""
        refs, policy = self._refs, self.policy
        for key in keys:
            r = refs.get(key)
            if r is None or r == WRITE_PENDING:
                raise KeyError(f"group {self.group_id}: key is not loadable")
        for key in keys:
            r = refs[key]
            if r == 0:
                policy.set_evictable(key, False)
            refs[key] = r + 1
        return [self._slot[k] for k in keys]

    def complete_load(self, keys: Sequence) -> None:
        refs, policy = self._refs, self.policy
        for key in keys:
            r = refs[key] - 1
            if r < 0:
                raise ValueError(f"group {self.group_id}: complete_load without prepare_load")
            refs[key] = r
            if r == 0:
                policy.set_evictable(key, True)

    def touch(self, keys: Sequence) -> None:
        self.policy.touch(keys)

    # -- stores --------------------------------------------------------------------------
    def new_keys(self, keys: Sequence) -> list:
        """Keys of a store call that are not resident or in flight, without duplicates."""
        slot = self._slot
        if len(keys) == 1:
            return [] if keys[0] in slot else list(keys)
        return [k for k in dict.fromkeys(keys) if k not in slot]

    def can_place(self, keys: Sequence, new: list | None = None) -> bool:
        """Would ``prepare_store(keys)`` succeed now? Changes nothing."""
        new = self.new_keys(keys) if new is None else new
        need = len(new) - self.free_count()
        if need <= 0:
            return True
        is_ev = self.policy.is_evictable
        protected_evictable = sum(1 for k in set(keys) if k in self._slot and is_ev(k))
        return self.policy.evictable_count() - protected_evictable >= need

    def prepare_store(self, keys: Sequence) -> StorePlan | None:
        """Reserve write-pending slots for the keys not yet present, evicting if needed.

        Returns None (nothing changed) when eviction cannot free enough slots now.
        """
        new = self.new_keys(keys)
        if not new:
            return StorePlan([], [], [])
        evicted: list = []
        need = len(new) - self.free_count()
        if need > 0:
            victims = self.policy.evict(need, keys if len(keys) < 8 else set(keys))
            if victims is None:
                self.stats.store_refusals += 1
                return None
            for key in victims:
                self._free.append(self._slot.pop(key))
                del self._refs[key]
            self.stats.evictions += len(victims)
            self.events.append(("removed", self.group_id, victims))
            evicted = victims
        slots = []
        free, slot, refs, inserted = self._free, self._slot, self._refs, self.policy.inserted
        for key in new:
            if free:
                s = free.pop()
            else:
                s = self._fresh
                self._fresh += 1
            slot[key] = s
            refs[key] = WRITE_PENDING
            inserted(key)
            slots.append(s)
        return StorePlan(new, slots, evicted)

    def complete_store(self, keys: Sequence, success: bool = True) -> None:
        """Publish written keys (success) or release their slots (failure)."""
        refs, policy = self._refs, self.policy
        done = []
        for key in keys:
            if refs.get(key) != WRITE_PENDING:
                continue
            if success:
                refs[key] = 0
                policy.set_evictable(key, True)
            else:
                del refs[key]
                self._free.append(self._slot.pop(key))
                policy.removed(key)
            done.append(key)
        if success:
            self.stats.stores += len(done)
            if done:
                self.events.append(("stored", self.group_id, done))
        else:
            self.stats.failed_stores += len(done)

    # -- housekeeping --------------------------------------------------------------------
    def take_events(self) -> list[tuple[str, int, object]]:
        events, self.events = self.events, []
        return events

    def reset(self) -> None:
        """Forget every idle key; pinned and write-pending keys stay (their users hold slots)."""
        idle = [k for k, r in self._refs.items() if r == 0]
        for key in idle:
            del self._refs[key]
            self._free.append(self._slot.pop(key))
            self.policy.removed(key)
        if idle:
            self.events.append(("removed", self.group_id, idle))

    def snapshot_stats(self) -> dict:
        s = self.stats
        return {
            "slots": self.capacity, "used": len(self._slot), "free": self.free_count(),
            "evictable": self.policy.evictable_count(), "lookups": s.lookups, "hits": s.hits,
            "stores": s.stores, "failed_stores": s.failed_stores, "evictions": s.evictions,
            "store_refusals": s.store_refusals,
        }
