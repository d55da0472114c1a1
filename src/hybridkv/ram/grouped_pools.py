"""Routes keys to their group's pool and makes multi-group stores atomic.

A store spanning groups first asks every pool whether it can place its keys and only then
reserves anything, so a refusal never evicts a page in another group for nothing (vLLM
rolls back reservations but its evictions are already done).

A state page serves only together with the attention page of the block it ends: when a store
evicts that page from RAM, the state can no longer give a RAM hit, so it is demoted to the
evicted-first end (a hit that uses it again makes it an ordinary page).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat

from hybridkv.ram.policies import EvictionPolicy
from hybridkv.ram.pool import Lookup, SlotPool, StorePlan, make_pool

log = logging.getLogger(__name__)

GroupKeys = Mapping[int, Sequence]


class GroupedPools:
    """``policy`` is a built-in policy's name or ``(group id, capacity) -> EvictionPolicy``;
    ``state_groups``: the groups holding recurrent states (the others hold a page per block)."""

    def __init__(self, slots_per_group: Mapping[int, int],
                 policy: str | Callable[[int, int], EvictionPolicy] = "lru", state_groups: Sequence[int] = ()):
        self._policy = policy
        self.state_groups = [gid for gid in state_groups if gid in slots_per_group]
        self.pools: dict[int, SlotPool] = {}
        self.resize(slots_per_group)
        self._request_pins: dict[str, Counter] = {}

    def resize(self, slots_per_group: Mapping[int, int]) -> None:
        """New, empty pools of these sizes (only while ``idle()``: nothing may hold a slot)."""
        if not self.idle():
            raise ValueError("pools cannot be resized while a slot is pinned or being written")
        policy = self._policy
        self.pools = {gid: make_pool(gid, n, policy if isinstance(policy, str) else policy(gid, n))
                      for gid, n in slots_per_group.items()}

    def idle(self) -> bool:
        """No slot is pinned or being written: every resident page could be evicted now."""
        return all(len(pool) == pool.evictable_count() for pool in self.pools.values())

    def pool(self, group_id: int) -> SlotPool:
        return self.pools[group_id]

    def free_slots(self, group_id: int) -> int:
        return self.pools[group_id].free_count()

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
                slots[gid] = self.pools[gid].prepare_load(ks)
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
        ``spare``: cold, and only into free slots: such a store never evicts a page."""
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
        if cold or spare:
            for gid, plan in plans.items():
                plan.spare = spare
                if plan.keys:
                    self.pools[gid].mark_cold(plan.keys)
        return plans

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
