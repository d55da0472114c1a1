"""Routes keys to their group's pool and makes multi-group stores atomic.

A store spanning groups first asks every pool whether it can place its keys and only then
reserves anything, so a refusal never evicts a page in another group for nothing (vLLM
rolls back reservations but its evictions are already done).

A state page serves only together with the attention page of the block it ends: when a store
evicts that page from RAM, the state can no longer give a RAM hit, so it is demoted to the
evicted-first end (a hit that uses it again makes it an ordinary page).

Over an ``Arena`` the pools share one budget: before a store evicts, its kind takes a unit of
segments from the other kind where that kind's free slots and the pages one LRU order would
evict before any of this kind's cover the unit and ``MOVE_MARGIN`` units more. The giving
pools evict their oldest pages until the unit's slots are free, and move the pages still in
those segments into free slots lower down (``relocated``: the owner of the bytes copies
them). Slots leaving the pools are then arena rows (``Arena.to_rows``). A spare store, which
never evicts, takes a unit only where the other kind's free slots alone cover it and the
margin: otherwise spare states could never grow their kind's share while the other kind sits
on empty segments.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat

from hybridkv.ram.arena import Arena
from hybridkv.ram.policies import EvictionPolicy
from hybridkv.ram.pool import Lookup, SlotPool, StorePlan, make_pool

log = logging.getLogger(__name__)

GroupKeys = Mapping[int, Sequence]
NEWEST = (1 << 64) - 1       # above every recency stamp: a kind with no evictable page
# Units of pages the other kind must hold, older than any of a kind's, beyond what a move
# evicts. Replaying traces at 0: the kinds traded a unit every few requests (the public chat
# hour at 128 GiB: 2,954 moves copying 656 GiB); at 3: 260 moves, 96 GiB, the same hit rate.
MOVE_MARGIN = 3


class GroupedPools:
    """``policy`` is a built-in policy's name or ``(group id, capacity) -> EvictionPolicy``;
    ``state_groups``: the groups holding recurrent states (the others hold a page per block);
    ``arena``: one budget the groups share (LRU only), instead of ``slots_per_group``."""

    def __init__(self, slots_per_group: Mapping[int, int],
                 policy: str | Callable[[int, int], EvictionPolicy] = "lru", state_groups: Sequence[int] = (),
                 arena: Arena | None = None):
        self._policy = policy
        self.state_groups = [gid for gid in state_groups if gid in slots_per_group]
        self.pools: dict[int, SlotPool] = {}
        self.arena: Arena | None = None
        self.relocated: list[list[tuple[int, int, int]]] = []   # per transfer: (group, from row, to row)
        self.resize(slots_per_group, arena)
        self._request_pins: dict[str, Counter] = {}

    def resize(self, slots_per_group: Mapping[int, int], arena: Arena | None = None) -> None:
        """New, empty pools of these sizes, or of the arena's segments (only while ``idle()``:
        nothing may hold a slot)."""
        if not self.idle():
            raise ValueError("pools cannot be resized while a slot is pinned or being written")
        if arena is not None:
            slots_per_group = arena.slots_per_group()
        policy = self._policy
        self.pools = {gid: make_pool(gid, n, policy if isinstance(policy, str) else policy(gid, n))
                      for gid, n in slots_per_group.items()}
        self.arena = arena
        self.relocated = []

    @property
    def shared_bytes(self) -> int | None:
        """Bytes the groups draw on together (the arena's), or None: each has its own slots."""
        return None if self.arena is None else self.arena.segments * self.arena.segment_bytes

    def idle(self) -> bool:
        """No slot is pinned or being written: every resident page could be evicted now."""
        return all(len(pool) == pool.evictable_count() for pool in self.pools.values())

    def pool(self, group_id: int) -> SlotPool:
        return self.pools[group_id]

    def free_slots(self, group_id: int) -> int:
        """Slots a store to this group could fill without evicting a page: the pool's free
        slots or, over an arena, the unit of segments it could take from free room (a page
        pinned in that unit can still make the store wait)."""
        free = self.pools[group_id].free_count()
        if free or self.arena is None:
            return free
        kind = self.arena.kind_of(group_id)
        if self.arena.can_take_unowned(kind) or self._other_can_give(kind, free_only=True):
            return self.arena.unit(kind)[1] * self.arena.rows[group_id]
        return 0

    def slot_of(self, group_id: int, key) -> int:
        """Where a resident key's page lies (its arena row, over an arena)."""
        slot = self.pools[group_id].slot_of(key)
        return slot if self.arena is None else self.arena.to_rows(group_id, [slot])[0]

    def lookup(self, group_id: int, key) -> Lookup:
        return self.pools[group_id].lookup(key)

    def touch(self, keys: GroupKeys) -> None:
        for gid, ks in keys.items():
            self.pools[gid].touch(ks)

    # -- loads: pins are remembered per request so a finished request never leaks one ----
    def prepare_load(self, keys: GroupKeys, request: str | None = None) -> dict[int, list[int]]:
        done: list[tuple[int, Sequence]] = []
        try:
            slots = {}
            for gid, ks in keys.items():
                got = self.pools[gid].prepare_load(ks)
                slots[gid] = got if self.arena is None else self.arena.to_rows(gid, got)
                done.append((gid, ks))
        except KeyError:
            for gid, ks in done:
                self.pools[gid].complete_load(ks)
            raise
        if request is not None:
            pins = self._request_pins.setdefault(request, Counter())
            for gid, ks in keys.items():
                pins.update(zip(repeat(gid), ks))      # counted in C
        return slots

    def complete_load(self, keys: GroupKeys, request: str | None = None) -> None:
        for gid, ks in keys.items():
            self.pools[gid].complete_load(ks)
        pins = self._request_pins.get(request) if request is not None else None
        if pins is not None:
            for gid, ks in keys.items():
                for k in ks:
                    key = (gid, k)
                    left = pins[key] - 1
                    if left > 0:
                        pins[key] = left
                    else:
                        del pins[key]

    # -- stores ----------------------------------------------------------------------------
    def prepare_store(self, keys: GroupKeys, cold: bool = False, spare: bool = False) -> dict[int, StorePlan] | None:
        """All groups place their keys, or none does (None = retry later, nothing changed).
        ``cold``: the new keys enter the eviction order where it evicts first (``mark_cold``);
        ``spare``: cold, and only into free slots (over an arena, segments the other kind holds
        free may move): such a store never evicts a page."""
        news = {gid: self.pools[gid].new_keys(ks) for gid, ks in keys.items()}
        if self.arena is not None:
            for gid in keys:
                self._make_room(gid, len(news[gid]), free_only=spare)
            if len({self.arena.kind_of(gid) for gid in keys}) > 1:   # a move evicts the other kind only
                news = {gid: self.pools[gid].new_keys(ks) for gid, ks in keys.items()}
        if spare and any(len(news[gid]) > self.pools[gid].free_count() for gid in keys):
            return None
        for gid, ks in keys.items():
            if not self.pools[gid].can_place(ks, news[gid]):
                self.pools[gid].store_refusals += 1
                return None
        plans = {gid: self.pools[gid].prepare_store(ks, news[gid]) for gid, ks in keys.items()}
        assert all(plan is not None for plan in plans.values()), "can_place promised room"
        for gid, plan in plans.items():
            if plan.evicted:
                self.evicted(gid, plan.evicted)
            if self.arena is not None:
                plan.slots = self.arena.to_rows(gid, plan.slots)
        return self.marked(plans, cold, spare)

    def marked(self, plans: dict[int, StorePlan], cold: bool, spare: bool) -> dict[int, StorePlan]:
        """``plans`` with the pages of a cold or spare store put where eviction takes first."""
        if cold or spare:
            for gid, plan in plans.items():
                plan.spare = spare
                if plan.keys:
                    self.pools[gid].mark_cold(plan.keys)
        return plans

    # -- one budget over an arena -----------------------------------------------------------
    def _make_room(self, group_id: int, need: int, free_only: bool = False) -> None:
        """Before a store in this group evicts: take units of segments nobody owns, then from
        the other kind while it holds enough pages older than any of this kind's (``free_only``:
        enough free slots, so that no page is evicted)."""
        arena = self.arena
        kind = arena.kind_of(group_id)
        while self.pools[group_id].free_count() < need:
            if not (arena.take_unowned(kind) or self._take_from_other(kind, free_only)):
                return
            for gid in arena.kinds[kind]:
                self.pools[gid].set_capacity(arena.capacity(gid))

    def _other_can_give(self, kind: str, free_only: bool) -> bool:
        """Could the other kind give ``kind`` a unit of segments: one LRU order would fill the
        unit's room, and ``MOVE_MARGIN`` units more, from the other kind's free slots and from
        pages it evicts before any of this kind's (``free_only``: from free slots alone)? The
        margin makes moves follow lasting shifts of the traffic, not one request's."""
        arena = self.arena
        donors = arena.kinds[arena.other(kind)]
        give = arena.unit(kind)[0]
        if any(len(arena.owned[gid]) <= give for gid in donors):
            return False
        wants = {gid: (1 + MOVE_MARGIN) * give * arena.rows[gid] - self.pools[gid].free_count() for gid in donors}
        if all(n <= 0 for n in wants.values()):
            return True
        if free_only:
            return False
        mine = [self.pools[gid].oldest() for gid in arena.kinds[kind]]
        before = min((m for m in mine if m is not None), default=NEWEST)
        return all(n <= 0 or self.pools[gid].older_than(before, n) >= n for gid, n in wants.items())

    def _take_from_other(self, kind: str, free_only: bool = False) -> bool:
        """Empty one unit of the other kind's last segments and hand it to ``kind``'s groups;
        False (segments unmoved) where the other kind cannot give (``_other_can_give``)."""
        if not self._other_can_give(kind, free_only):
            return False
        arena = self.arena
        donors = arena.kinds[arena.other(kind)]
        shrunk, moved = [], []
        for gid in donors:
            pool = self.pools[gid]
            unit = arena.unit(kind)[0] * arena.rows[gid]      # slots this donor gives
            short = unit - pool.free_count()
            target = pool.capacity - unit
            victims = pool.evict_lru(short) if short > 0 else []
            if victims is None:
                break
            self.evicted(gid, victims)
            moves = pool.set_capacity(target)
            if moves is None:
                break
            moved += [(gid, *arena.to_rows(gid, [src, dst])) for _, src, dst in moves]
            shrunk.append(gid)
        if moved:                 # slots changed, whether the unit moves or not: the bytes follow
            self.relocated.append(moved)
        if len(shrunk) == len(donors):
            arena.transfer(kind)
            return True
        for gid in shrunk:                # a page it must not move: the others keep their room
            self.pools[gid].set_capacity(arena.capacity(gid))
        return False

    def take_relocated(self) -> list[list[tuple[int, int, int]]]:
        """Pages moved between rows since the last call, one list per transfer of a unit, each
        move (group, from row, to row): the owner of the bytes copies them before anyone reads
        the new rows. Within a list no two moves share a row (each goes from a segment given
        away to a free slot the group keeps); a later transfer in the same store may move again
        a page an earlier one moved, so the lists are copied one after the other, in order."""
        moved, self.relocated = self.relocated, []
        return moved

    def evicted(self, group_id: int, keys: Sequence) -> None:
        """``keys`` left this group's pool: where they were attention pages, the states ending
        at their blocks cannot serve from RAM any more and go first."""
        if group_id not in self.state_groups:
            for gid in self.state_groups:
                self.pools[gid].mark_cold(keys)

    def complete_store(self, keys: GroupKeys, success: bool = True) -> None:
        for gid, ks in keys.items():
            self.pools[gid].complete_store(ks, success)

    # -- lifecycle -------------------------------------------------------------------------
    def request_started(self, request: str) -> None:
        self._request_pins.setdefault(request, Counter())

    def request_finished(self, request: str) -> int:
        """Release pins the request still holds; returns how many were leaked."""
        pins = self._request_pins.pop(request, None)
        if not pins:
            return 0
        leaked = 0
        for (gid, key), n in pins.items():
            for _ in range(n):
                self.pools[gid].complete_load([key])
            leaked += n
        log.warning("request %s finished holding %d pins; released", request, leaked)
        return leaked

    def open_requests(self) -> int:
        """Requests started and not finished (each may hold pins)."""
        return len(self._request_pins)

    def stats(self) -> dict[int, dict]:
        return {gid: pool.snapshot_stats() for gid, pool in self.pools.items()}

    def reset(self) -> None:
        for pool in self.pools.values():
            pool.reset()

    def shutdown(self) -> None:
        for request in list(self._request_pins):
            self.request_finished(request)
