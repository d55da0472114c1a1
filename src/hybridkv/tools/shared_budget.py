"""The bound of any rule that moves RAM between attention pages and states.

The cache's arena moves whole segments between the two kinds, a unit at a time, and only
once the other kind holds enough pages one LRU order would evict first (``GroupedPools``).
``SharedBudgetPools`` is what that approximates: every group draws on one byte budget, pages
leave in one least-recently-used order whatever their kind, and no byte is lost to segments.
It keeps keys only (no region could be laid out that way), so it serves the simulator's
pageless cache, where ``replay(..., shared_budget=True)`` measures it beside the arena.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

from hybridkv.core.layout import GroupKind, Layout
from hybridkv.ram.grouped_pools import GroupedPools, GroupKeys
from hybridkv.ram.policies import EvictionPolicy
from hybridkv.ram.pool import SlotPool, StorePlan


class _GroupView(EvictionPolicy):
    """One group's keys in the shared order (front: evicted first). The pool never evicts
    by itself: it is as large as the whole budget, and ``SharedBudgetPools`` evicts."""

    def __init__(self, group_id: int, order: OrderedDict):
        self.gid, self.order, self.count = group_id, order, 0

    def set_evictable(self, key, evictable):
        entry = (self.gid, key)
        if evictable:
            self.count += entry not in self.order
            self.order[entry] = None
            self.order.move_to_end(entry)
        elif entry in self.order:
            del self.order[entry]
            self.count -= 1

    def removed(self, key):
        if (self.gid, key) in self.order:
            del self.order[(self.gid, key)]
            self.count -= 1

    def demote(self, key):
        if (self.gid, key) in self.order:
            self.order.move_to_end((self.gid, key), last=False)

    def touch(self, keys):
        order = self.order
        for key in reversed(keys):
            if (self.gid, key) in order:
                order.move_to_end((self.gid, key))

    def evict(self, n, protected):
        return None if n > 0 else []

    def evictable_count(self):
        return self.count

    def is_evictable(self, key):
        return (self.gid, key) in self.order


class SharedBudgetPools(GroupedPools):
    """``GroupedPools`` whose groups hold at most ``budget_bytes`` together (``page_bytes``:
    each group's page size); a store evicts the least recently used pages of any group."""

    def __init__(self, slots_per_group: Mapping[int, int], budget_bytes: int, page_bytes: Mapping[int, int],
                 state_groups: Sequence[int] = ()):
        self.budget_bytes, self.page_bytes = budget_bytes, dict(page_bytes)
        self.order: OrderedDict[tuple[int, Hashable], None] = OrderedDict()
        super().__init__(slots_per_group, state_groups=state_groups)

    def resize(self, slots_per_group: Mapping[int, int], arena: object = None) -> None:
        """New, empty pools for these groups; their sizes come from the budget, not the plan
        (nor an arena)."""
        if not self.idle():
            raise ValueError("pools cannot be resized while a slot is pinned or being written")
        self.order.clear()
        self.pools = {gid: SlotPool(gid, self.budget_bytes // self.page_bytes[gid] + 1, _GroupView(gid, self.order))
                      for gid in slots_per_group}

    @property
    def shared_bytes(self) -> int:
        return self.budget_bytes

    def bytes_used(self) -> int:
        return sum(len(pool) * self.page_bytes[gid] for gid, pool in self.pools.items())

    def free_slots(self, group_id: int) -> int:
        return max(0, self.budget_bytes - self.bytes_used()) // self.page_bytes[group_id]

    def prepare_store(self, keys: GroupKeys, cold: bool = False, spare: bool = False) -> dict[int, StorePlan] | None:
        """All groups place their keys, evicting the least recently used pages of any group,
        or none does (None); ``spare`` stores only into free room, as the split pools do."""
        news = {gid: self.pools[gid].new_keys(ks) for gid, ks in keys.items()}
        need = self.bytes_used() + sum(len(n) * self.page_bytes[gid] for gid, n in news.items()) - self.budget_bytes
        if need > 0:
            victims = None if spare else self._victims(need, {(gid, k) for gid, ks in keys.items() for k in ks})
            if victims is None:
                if not spare:
                    for gid in keys:
                        self.pools[gid].store_refusals += 1
                return None
            for gid, key in victims:
                self.pools[gid].evict_key(key)
                self.evicted(gid, [key])
        return self.marked({gid: self.pools[gid].prepare_store(ks, news[gid]) for gid, ks in keys.items()}, cold, spare)

    def _victims(self, need: int, protected: set) -> list[tuple[int, Hashable]] | None:
        """The least recently used evictable pages whose bytes cover ``need``, or None."""
        victims, freed = [], 0
        for entry in self.order:
            if entry in protected:
                continue
            victims.append(entry)
            freed += self.page_bytes[entry[0]]
            if freed >= need:
                return victims
        return None


def shared_pools_for(budget_bytes: int, layout: Layout):
    """A ``TieredCache(pools=...)`` factory: ``SharedBudgetPools`` over this budget."""
    pages = {g.id: g.page_bytes for g in layout.groups}
    states = [g.id for g in layout.groups if g.kind is GroupKind.STATE]
    return lambda slots_per_group: SharedBudgetPools(slots_per_group, budget_bytes, pages, states)
