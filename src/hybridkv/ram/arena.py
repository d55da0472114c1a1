"""One RAM budget shared by the groups' pools: equal segments, each owned by one group.

A static split of the budget between attention pages and recurrent states suits one mix of
traffic only: replaying traces, one kind's pool evicted pages it needed while the other's
held pages older than any it kept. Here the budget is one arena of equal segments, each
the least common multiple of the page sizes, so it holds whole pages of any group. Groups
start with the segments the static plan gives them; ``GroupedPools`` then moves segments to
the kind (attention pages or states) whose least recently used page is younger than the
other kind's, so RAM evicts close to one LRU order across kinds.

A pool's slots stay local (0 .. capacity-1, its segments in the order it got them); ``row``
turns one into the row of the arena seen with the group's page size. Rows are what leave the
pools: a group's region is that view of the arena, so the owner and every worker compute a
page's address from the row alone, with no table to share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridkv.core.layout import GroupKind, Layout
from hybridkv.core.planner import Plan

# Fewer segments and a move is too coarse to follow the traffic: the split stays static. On
# Qwen3-Next a move is 3 segments (594 MiB); with 41 of them (8 GiB) chat users taking turns
# fell 68.9 -> 66.0% and agents 86.2 -> 83.2% against the static split.
MIN_SEGMENTS = 64
MAX_SEGMENTS = 1 << 16  # more and segments grow (a multiple of the least one): the tables stay small


def _by_kind(plan: Plan, layout: Layout) -> dict[str, list]:
    """The plan's groups that have slots, per kind: ``"token"`` and ``"state"``."""
    groups = [g for g in plan.groups if g.slots > 0]
    return {kind: [g for g in groups if (layout.group(g.id).kind is GroupKind.STATE) == (kind == "state")]
            for kind in ("token", "state")}


class Arena:
    """Which group owns which segment; ``owned[gid]`` in the order the pool's slots fill them.
    ``kinds``: the groups of each kind, ``"token"`` and ``"state"``."""

    def __init__(self, plan: Plan, layout: Layout, segment_bytes: int):
        self.segment_bytes = segment_bytes
        self.segments = plan.budget_bytes // segment_bytes
        groups = [g for g in plan.groups if g.slots > 0]
        self.rows = {g.id: segment_bytes // g.page_bytes for g in groups}
        self.kinds = {kind: [g.id for g in gs] for kind, gs in _by_kind(plan, layout).items()}
        # the static plan's split in whole segments (at least one a group), rounded down
        want = {g.id: max(1, g.slots // self.rows[g.id]) for g in groups}
        while sum(want.values()) > self.segments:
            want[max(self.kinds["token"], key=want.get)] -= 1
        self.owned: dict[int, list[int]] = {}
        first = 0
        for gid, n in want.items():
            self.owned[gid] = list(range(first, first + n))
            first += n
        self.unowned = list(range(self.segments - 1, first - 1, -1))   # popped lowest first
        self.moves = 0

    @classmethod
    def for_plan(cls, plan: Plan, layout: Layout) -> Arena | None:
        """The arena for ``plan``'s budget, or None where a static split must do: one kind
        only, two page sizes within a kind, or fewer than ``MIN_SEGMENTS`` segments."""
        by_kind = _by_kind(plan, layout)
        if any(len({g.page_bytes for g in gs}) != 1 for gs in by_kind.values()):
            return None
        segment = math.lcm(*(g.page_bytes for gs in by_kind.values() for g in gs))
        if plan.budget_bytes // segment < MIN_SEGMENTS:
            return None
        return cls(plan, layout, segment * -(-plan.budget_bytes // segment // MAX_SEGMENTS))

    def capacity(self, gid: int) -> int:
        return len(self.owned[gid]) * self.rows[gid]

    def slots_per_group(self) -> dict[int, int]:
        return {gid: self.capacity(gid) for gid in self.owned}

    def to_rows(self, gid: int, slots: Sequence[int]) -> list[int]:
        rows, owned = self.rows[gid], self.owned[gid]
        return [owned[s // rows] * rows + s % rows for s in slots]

    def view_rows(self, gid: int) -> int:
        """Rows of the whole arena seen with this group's page size (its region's slots)."""
        return self.segments * self.rows[gid]

    def kind_of(self, gid: int) -> str:
        return "state" if gid in self.kinds["state"] else "token"

    def other(self, kind: str) -> str:
        return "token" if kind == "state" else "state"

    def unit(self, kind: str) -> tuple[int, int]:
        """Segments a move takes from each group of the other kind and gives each of ``kind``'s
        (every group of a kind grows and shrinks together, as its pages are stored together)."""
        takers, givers = len(self.kinds[kind]), len(self.kinds[self.other(kind)])
        moved = math.lcm(takers, givers)
        return moved // givers, moved // takers

    def segments_in_use(self, gid: int, slots: int) -> list[int]:
        """The segments holding this group's first ``slots`` local slots."""
        return self.owned[gid][:-(-slots // self.rows[gid])]

    def can_take_unowned(self, kind: str) -> bool:
        """Are enough segments nobody owns left for a unit of ``kind``?"""
        return len(self.unowned) >= self.unit(kind)[1] * len(self.kinds[kind])

    def take_unowned(self, kind: str) -> bool:
        """Give each of ``kind``'s groups its unit from the segments nobody owns, if enough are left."""
        if not self.can_take_unowned(kind):
            return False
        each = self.unit(kind)[1]
        for gid in self.kinds[kind]:
            self.owned[gid] += [self.unowned.pop() for _ in range(each)]
        self.moves += 1
        return True

    def transfer(self, kind: str) -> None:
        """Move one unit from the other kind's groups (their last segments, which their pools
        have emptied) to ``kind``'s."""
        give, get = self.unit(kind)
        freed = sorted(s for gid in self.kinds[self.other(kind)] for s in self._pop(gid, give))
        for i, gid in enumerate(self.kinds[kind]):
            self.owned[gid] += freed[i * get:(i + 1) * get]
        self.moves += 1

    def _pop(self, gid: int, n: int) -> list[int]:
        taken, self.owned[gid] = self.owned[gid][-n:], self.owned[gid][:-n]
        return taken
