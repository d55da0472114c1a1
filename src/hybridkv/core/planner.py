"""Sizes the per-group RAM pools from one byte budget.

Token groups get N slots each; a state group gets only as many as the retention policy
can fill for the requests N token slots hold, plus one junction per request (which tail
states share).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import GroupKind, Layout
from hybridkv.core.retention import Retention


@dataclass(frozen=True)
class GroupPlan:
    id: int
    kind: str
    page_bytes: int
    slots: int

    @property
    def bytes(self) -> int:
        return self.slots * self.page_bytes


@dataclass(frozen=True)
class Plan:
    block_tokens: int
    budget_bytes: int
    retention: int | None
    reference_tokens: int
    token_slots: int
    groups: tuple[GroupPlan, ...]

    @property
    def bytes_used(self) -> int:
        return sum(g.bytes for g in self.groups)

    @property
    def contexts(self) -> float:
        return self.token_slots * self.block_tokens / self.reference_tokens

    def slots_per_group(self) -> dict[int, int]:
        return {g.id: g.slots for g in self.groups if g.slots > 0}

    def to_dict(self) -> dict:
        return {
            "block_tokens": self.block_tokens, "budget_bytes": self.budget_bytes,
            "retention": self.retention, "reference_tokens": self.reference_tokens,
            "token_slots": self.token_slots, "contexts": self.contexts,
            "bytes_used": self.bytes_used,
            "groups": [{"id": g.id, "kind": g.kind, "page_bytes": g.page_bytes,
                        "slots": g.slots, "bytes": g.bytes} for g in self.groups],
        }


def default_reference_tokens(layout: Layout) -> int:
    """The prompt length pools are sized for when ``reference_tokens`` is not set: the model's
    maximum. Safe for KV, but where traffic is shorter it sizes the state pools for far fewer
    requests than the KV pages hold, and states are evicted before they are reused."""
    return layout.max_model_len or 64 * layout.block_tokens


def unset_reference_warning(layout: Layout, reference_tokens: int | None, shared_budget: bool) -> str | None:
    """What a server should say at start when nobody said how long prompts are: RAM split
    statically is split for the longest ones until the traffic has shown its mean, then
    emptied. None when there is nothing to say: the length is given, no state is cached, or
    the groups share one budget (``shared_budget``: the split follows the traffic anyway)."""
    if (reference_tokens is not None or shared_budget
            or not any(g.kind is GroupKind.STATE for g in layout.cacheable_groups)):
        return None
    return (f"reference_tokens is not set: RAM is split between KV and states for "
            f"{default_reference_tokens(layout)}-token prompts (too few states for shorter ones) until the "
            "traffic's mean prompt is known, then re-planned, dropping what RAM holds. Set it to your mean "
            "prompt length to start right; `hybridkv simulate --trace` measures the difference")


def state_slots(token_slots: int, block_tokens: int, reference_tokens: int,
                retention: Retention) -> int:
    if retention.dense:
        return token_slots
    requests = -(-token_slots * block_tokens // reference_tokens)
    # one more per request for a junction; tail states share it (replaying traces, budgeting
    # them on top cost up to 30% of the hit rate where prompts are short and states dominate)
    return requests * (retention.states_per_prompt(reference_tokens) + (0 if retention.tail else 1))


def plan_pools(
    layout: Layout,
    budget_bytes: int,
    retention: int | None = 0,
    reference_tokens: int | None = None,
    engine_block_tokens: int | None = None,
    tail_states: int = 0,
) -> Plan:
    """Largest N with N*sum(token pages) + sum(S(N)*state page) <= budget; refuses what cannot work."""
    B = layout.block_tokens
    cacheable = layout.cacheable_groups
    if not cacheable:
        raise HybridKVError("layout has no cacheable group (all scratch); nothing to cache")
    if reference_tokens is None:
        reference_tokens = layout.max_model_len
    if reference_tokens is None:
        raise HybridKVError("the layout has no max_model_len; pass --reference-tokens R")
    if reference_tokens < B:
        raise HybridKVError(
            f"reference length {reference_tokens} is shorter than one block ({B} tokens); "
            "use a typical request length"
        )
    if budget_bytes <= 0:
        raise HybridKVError("budget must be > 0; give e.g. --budget 4GiB")
    has_state = any(g.kind is GroupKind.STATE for g in cacheable)
    if (retention is not None and has_state and engine_block_tokens is not None
            and engine_block_tokens < B):
        raise HybridKVError(
            f"offload block {B} is larger than the engine block {engine_block_tokens} under sparse "
            "retention: kept states would not fall on offload boundaries; use --retention dense "
            "or an offload block equal to the engine block"
        )
    policy = Retention(B, retention, tail_states)
    token_bytes, state_bytes = layout.block_bytes, layout.state_bytes

    def cost(n: int) -> int:
        return n * token_bytes + state_slots(n, B, reference_tokens, policy) * state_bytes

    if cost(1) > budget_bytes:
        minimum = cost(1)
        raise HybridKVError(
            f"budget {budget_bytes} B cannot hold one slot per cacheable group "
            f"(needs {minimum} B); raise the budget or use a smaller block size"
        )
    lo, hi = 1, 2
    while cost(hi) <= budget_bytes:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget_bytes else (lo, mid)
    n = lo
    s = state_slots(n, B, reference_tokens, policy)
    groups = tuple(
        GroupPlan(g.id, g.kind, g.page_bytes,
                  0 if not g.cacheable else (n if g.is_token_group else s))
        for g in layout.groups
    )
    return Plan(B, budget_bytes, retention, reference_tokens, n, groups)
