"""A fixed pool of page-sized slots for one cacheable group.

Each resident key owns one slot and a reference count: ``-1`` while its bytes are being
written (invisible to loads), ``0`` when stored and evictable, ``> 0`` while pinned by
loads or background copies. Slot ids are local to the pool.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from hybridkv.ram.policies import EvictionPolicy, make_policy

WRITE_PENDING = -1


class Lookup(Enum):
    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"   # being written: ask again next step


MISS, HIT, HIT_PENDING = Lookup.MISS, Lookup.HIT, Lookup.HIT_PENDING


@dataclass(slots=True)
class StorePlan:
    """What ``prepare_store`` reserved: keys to write now, their slots, and keys evicted;
    ``spare``: pages nobody asked to keep, placed in free slots only (not written through
    until used)."""

    keys: list
    slots: list[int]
    evicted: list = field(default_factory=list)
    spare: bool = False


class PoolEntry:
    """A resident key's slot and reference count: ``WRITE_PENDING`` until its bytes land (not
    ready: invisible to loads), 0 when evictable, the number of pins otherwise; ``cold``: it
    re-enters the eviction order where the policy evicts first (``mark_cold``). A class with
    ``__slots__`` rather than a dataclass: this is created once per store on the hot path."""

    __slots__ = ("slot", "refs", "cold")

    def __init__(self, slot: int, refs: int = WRITE_PENDING):
        self.slot, self.refs, self.cold = slot, refs, False


class _Visibility(dict):
    """key -> HIT or HIT_PENDING for every resident key; an absent key reads as MISS. A lookup
    is then one C-level subscript, the hot path of every hit check (2x a Python method)."""

    __slots__ = ()

    def __missing__(self, key) -> Lookup:
        return MISS


class PoolReports:
    """What both pools (this module's and compiled_pool's) report the same way. Each has
    the counters below, ``capacity``, ``free_count()`` and ``evictable_count()``."""

    __slots__ = ()

    def snapshot_stats(self) -> dict:
        return {
            "slots": self.capacity, "used": len(self), "free": self.free_count(),
            "evictable": self.evictable_count(), "stores": self.stores,
            "failed_stores": self.failed_stores, "evictions": self.evictions,
            "store_refusals": self.store_refusals,
        }


class SlotPool(PoolReports):
    """One group's slots, in Python: the fallback of the compiled pool and the pool of any
    policy registered in Python. ``lookup(key)`` -> ``Lookup`` (MISS, HIT, HIT_PENDING) is
    bound in ``__init__`` to the visibility map itself."""

    lookup: Callable[[object], Lookup]

    def __init__(self, group_id: int, capacity: int, policy: str | EvictionPolicy = "lru"):
        if capacity <= 0:
            raise ValueError(f"group {group_id}: a pool needs at least one slot")
        self.group_id = group_id
        self.capacity = capacity
        self.policy = make_policy(policy, capacity) if isinstance(policy, str) else policy
        self._entries: dict[object, PoolEntry] = {}
        self._visible = _Visibility()
        self.lookup = self._visible.__getitem__
        self._free: list[int] = []
        self.slots_used = 0        # slots ever handed out, from 0 up; the rest wait here (lazy free list)
        self.stores = self.failed_stores = self.evictions = self.store_refusals = 0

    # -- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def resident_keys(self) -> list:
        return list(self._entries)

    def free_count(self) -> int:
        return len(self._free) + self.capacity - self.slots_used

    def evictable_count(self) -> int:
        return self.policy.evictable_count()

    def slot_of(self, key) -> int:
        return self._entries[key].slot

    def refs_of(self, key) -> int | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.refs

    # -- loads ---------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence) -> list[int]:
        """Pin stored keys and return their slots; raises KeyError for a key not loadable."""
        entries, policy = self._entries, self.policy
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.refs == WRITE_PENDING:
                raise KeyError(f"group {self.group_id}: key is not loadable")
        slots = []
        for key in keys:
            entry = entries[key]
            if entry.refs == 0:
                policy.set_evictable(key, False)
            entry.refs += 1
            slots.append(entry.slot)
        return slots

    def complete_load(self, keys: Sequence) -> None:
        entries = self._entries
        for key in keys:
            entry = entries[key]
            if entry.refs <= 0:
                raise ValueError(f"group {self.group_id}: complete_load without prepare_load")
            entry.refs -= 1
            if entry.refs == 0:
                self._evictable(key, entry)

    # -- stores --------------------------------------------------------------------------
    def new_keys(self, keys: Sequence) -> list:
        """Keys of a store call that are not resident or in flight, without duplicates."""
        entries = self._entries
        if len(keys) == 1:
            return [] if keys[0] in entries else list(keys)
        return [k for k in dict.fromkeys(keys) if k not in entries]

    def can_place(self, keys: Sequence, new: list | None = None) -> bool:
        """Would ``prepare_store(keys)`` succeed now? Changes nothing."""
        new = self.new_keys(keys) if new is None else new
        need = len(new) - self.free_count()
        if need <= 0:
            return True
        is_ev = self.policy.is_evictable
        protected_evictable = sum(1 for k in set(keys) if k in self._entries and is_ev(k))
        return self.policy.evictable_count() - protected_evictable >= need

    def prepare_store(self, keys: Sequence, new: list | None = None) -> StorePlan | None:
        """Reserve write-pending slots for the keys not yet present, evicting if needed.

        ``new`` is ``new_keys(keys)`` when the caller already has it. Returns None (nothing
        changed) when eviction cannot free enough slots now.
        """
        entries, free = self._entries, self._free
        if new is None:
            new = self.new_keys(keys)
        if not new:
            return StorePlan([], [], [])
        evicted: list = []
        need = len(new) - len(free) - self.capacity + self.slots_used
        if need > 0:
            victims = self.policy.evict(need, keys if len(keys) < 8 else set(keys))
            if victims is None:
                self.store_refusals += 1
                return None
            self._drop(victims)
            evicted = victims
        slots = []
        inserted, visible = self.policy.inserted, self._visible
        for key in new:
            if free:
                s = free.pop()
            else:
                s = self.slots_used
                self.slots_used += 1
            entries[key] = PoolEntry(s)
            visible[key] = HIT_PENDING
            inserted(key)
            slots.append(s)
        return StorePlan(new, slots, evicted)

    def _evictable(self, key, entry: PoolEntry) -> None:
        """A published or released key enters the eviction order: at its evicted-first end if
        stored cold (as ``set_evictable`` does in the compiled pool)."""
        self.policy.set_evictable(key, True)
        if entry.cold:
            self.policy.demote(key)

    def touch(self, keys: Sequence) -> None:
        """Keys of one request, in prefix order, were used: the prefix ends up most recent,
        and a page stored cold re-enters the order as any page does from now on."""
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is not None:
                entry.cold = False
        self.policy.touch(keys)

    def mark_cold(self, keys: Sequence) -> None:
        """Resident keys (a store the caller expects no reuse of) re-enter the eviction order
        where the policy evicts first, now if evictable and whenever they are released, until
        a hit's ``touch`` makes them ordinary pages."""
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is not None:
                entry.cold = True
                if entry.refs == 0:
                    self.policy.demote(key)

    def complete_store(self, keys: Sequence, success: bool = True) -> None:
        """Publish written keys (success) or release their slots (failure)."""
        entries, policy = self._entries, self.policy
        if success and len(keys) == 1:  # the common case, without list building
            entry = entries.get(keys[0])
            if entry is not None and entry.refs == WRITE_PENDING:
                entry.refs = 0
                self._visible[keys[0]] = HIT
                self._evictable(keys[0], entry)
                self.stores += 1
            return
        done = []
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.refs != WRITE_PENDING:
                continue
            if success:
                entry.refs = 0
                self._visible[key] = HIT
                self._evictable(key, entry)
            else:
                del entries[key]
                del self._visible[key]
                self._free.append(entry.slot)
                policy.removed(key)
            done.append(key)
        if not done:
            return
        if success:
            self.stores += len(done)
        else:
            self.failed_stores += len(done)

    def _drop(self, victims: list) -> None:
        """Free the slots of keys the policy has just evicted."""
        entries, free, visible = self._entries, self._free, self._visible
        for key in victims:
            free.append(entries.pop(key).slot)
            del visible[key]
        self.evictions += len(victims)

    def evict_key(self, key) -> None:
        """Evict one evictable key an owner chose (pools sharing one budget pick their victims
        across groups); raises KeyError for a key that is absent, pinned or being written."""
        if not self.policy.is_evictable(key):
            raise KeyError(f"group {self.group_id}: key is not evictable")
        self.policy.removed(key)
        self._drop([key])

    # -- a budget shared with other pools ------------------------------------------------
    def oldest(self) -> int | None:
        """When the page eviction takes next last became most recent (``policies.RECENCY``;
        0: stored cold), None where no page is evictable."""
        return self.policy.oldest()

    def older_than(self, stamp: int, limit: int) -> int:
        """How many of the pages eviction takes first became most recent before ``stamp``
        (counted up to ``limit``): what one LRU order over this pool and another would evict
        here before that pool's oldest page."""
        return self.policy.older_than(stamp, limit)

    def evict_lru(self, n: int) -> list | None:
        """Evict the ``n`` pages eviction takes first, now; None (nothing changed) where fewer
        are evictable."""
        victims = self.policy.evict(n, ())
        if victims is not None:
            self._drop(victims)
        return victims

    def set_capacity(self, capacity: int) -> list[tuple[object, int, int]] | None:
        """Grow, or shrink: the pages in slots at or past ``capacity`` move to the lowest free
        slots below it (the free slots below are then in ascending order; untouched where no
        slot past the end was ever handed out). Returns those moves as (key, from, to), lowest
        ``from`` first, for the caller to copy the bytes; None (nothing changed) where one of
        them is pinned or being written, or too few slots below are free."""
        if capacity <= 0:
            raise ValueError(f"group {self.group_id}: a pool needs at least one slot")
        if self.slots_used <= capacity:      # no slot past the end was ever handed out
            self.capacity = capacity
            return []
        above = sorted((e.slot, k) for k, e in self._entries.items() if e.slot >= capacity)
        below = sorted(s for s in self._free if s < capacity)
        if any(self._entries[k].refs != 0 for _, k in above) or len(above) > len(below):
            return None
        moves = [(k, slot, to) for (slot, k), to in zip(above, below, strict=False)]
        for key, _, to in moves:
            self._entries[key].slot = to
        self._free = below[len(moves):]
        self.slots_used = min(self.slots_used, capacity)
        self.capacity = capacity
        return moves

    # -- housekeeping --------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every idle key; pinned and write-pending keys stay (their users hold slots)."""
        idle = [k for k, e in self._entries.items() if e.refs == 0]
        for key in idle:
            self._free.append(self._entries.pop(key).slot)
            del self._visible[key]
            self.policy.removed(key)


def make_pool(group_id: int, capacity: int, policy: str | EvictionPolicy = "lru") -> SlotPool:
    """The compiled pool (ram/_slotpool.c) for a built-in policy when the extension was built
    and ``HYBRIDKV_PURE_PYTHON_POOL`` is not set; else ``SlotPool``. Both behave the same."""
    if isinstance(policy, str) and policy in ("lru", "arc") and not os.environ.get("HYBRIDKV_PURE_PYTHON_POOL"):
        try:
            from hybridkv.ram.compiled_pool import CompiledSlotPool
        except ImportError:   # built without a C compiler: the Python pool serves
            pass
        else:
            return CompiledSlotPool(group_id, capacity, policy)
    return SlotPool(group_id, capacity, policy)
