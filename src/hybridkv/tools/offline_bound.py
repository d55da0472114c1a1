"""An upper bound on what any cache that pays for its states can restore from a trace.

The attention-only ceiling lets states cost nothing, so where states are large it promises
hits no cache can give. This bound charges them. A hit at depth ``n`` blocks for request
``r`` needs, at that moment, the attention pages of its ``n`` blocks and the state at their
end, each resident since the last request that held that block (the one that could have
stored it; the earliest a page can exist). So the hit occupies ``page bytes x requests
elapsed`` of RAM for each page, and no other hit occupies that same stretch of that page.
RAM holds at most ``budget`` bytes at each of the trace's requests, so all chosen hits
together occupy at most ``budget x requests``. Choosing each request's depth to restore
the most tokens within that total is a multiple-choice knapsack; its linear relaxation
(each request's options reduced to their upper convex hull, then taken best value per byte
first) is an upper bound of it, hence of any cache, even one that knows the future.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.core.layout import GroupKind, Layout
from hybridkv.core.retention import replay_boundary


def _hull(costs: np.ndarray, values: np.ndarray) -> list[tuple[float, float]]:
    """The upper convex hull of ``(0, 0)`` and the options, as (cost, value) steps of falling
    value per cost: each step is what one more unit of a request's RAM buys."""
    points = sorted(zip(costs.tolist(), values.tolist(), strict=True))
    frontier = [(0.0, 0.0)]
    for c, v in points:                 # keep options that restore more than any cheaper one
        if v > frontier[-1][1]:
            if c == frontier[-1][0]:
                frontier.pop()
            frontier.append((c, v))
    hull = [frontier[0]]
    for c, v in frontier[1:]:
        while len(hull) >= 2:
            (c1, v1), (c2, v2) = hull[-2], hull[-1]
            if (v2 - v1) * (c - c1) <= (v - v1) * (c2 - c1):    # hull[-1] lies under the chord
                hull.pop()
            else:
                break
        hull.append((c, v))
    return [(c2 - c1, v2 - v1) for (c1, v1), (c2, v2) in zip(hull, hull[1:], strict=False)]


def states_paid_bound(layout: Layout, prompts: Sequence[np.ndarray], budgets: Sequence[int]) -> list[float]:
    """Per budget, the largest token hit rate any cache holding at most that many bytes of
    attention pages and states can reach on ``prompts`` (see the module's docstring)."""
    B = layout.block_tokens
    block_bytes = sum(g.page_bytes for g in layout.cacheable_groups if g.is_token_group)
    state_bytes = sum(g.page_bytes for g in layout.cacheable_groups if g.kind is GroupKind.STATE)
    children: dict[tuple[int, int], int] = {}
    last_held: dict[int, int] = {}
    steps: list[tuple[float, float]] = []
    prompt_tokens = 0
    for r, tokens in enumerate(prompts):
        prompt_tokens += len(tokens)
        raw = np.ascontiguousarray(tokens, dtype=np.int64).tobytes()
        step, node, gaps = B * 8, 0, []
        servable = replay_boundary(len(tokens), B) // B
        for i in range(len(tokens) // B):
            edge = (node, hash(raw[i * step:(i + 1) * step]))
            node = children.setdefault(edge, len(children) + 1)
            if len(gaps) == i and i < servable and node in last_held:
                gaps.append(r - last_held[node])
            last_held[node] = r
        if gaps:
            g = np.asarray(gaps, dtype=np.float64)
            costs = block_bytes * np.cumsum(g) + state_bytes * g
            steps += _hull(costs, B * np.arange(1, len(g) + 1, dtype=np.float64))
    order = sorted(steps, key=lambda s: s[1] / s[0] if s[0] else float("inf"), reverse=True)
    costs = np.array([c for c, _ in order])
    values = np.array([v for _, v in order])
    spent, gained = np.cumsum(costs), np.cumsum(values)
    rates = []
    for budget in budgets:
        room = float(budget) * len(prompts)
        k = int(np.searchsorted(spent, room, side="right"))       # steps that fit whole
        total = gained[k - 1] if k else 0.0
        if k < len(order):                                        # and a share of the next
            total += values[k] * (room - (spent[k - 1] if k else 0.0)) / costs[k]
        rates.append(float(total) / max(1, prompt_tokens))
    return rates
