"""Replays traffic through the real connector and cache — no model, no page bytes.

Each request is only token ids: the ``Connector`` keys it, finds its hybrid hit, pins and
releases the hit's pages and takes the offers a real engine makes (every full block, the
states the policy keeps) into a ``TieredCache`` whose regions hold no bytes. What comes out
is what a user chooses a cache by: token hit rate, prefill tokens and FLOPs saved, bytes
stored per hit token, and wrong hits, checked against ``PrefixTruth``, an index of the
replayed prompts that shares nothing with the connector's keys or hit rule.

A ``Policy`` is which states are kept (``Retention``) plus how RAM evicts. ``policy(name)``
builds the named ones the comparison runs; ``recommended`` is hybridkv's default.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hybridkv.cache import RAM, TieredCache
from hybridkv.config import CacheConfig
from hybridkv.connector import Connector
from hybridkv.core.errors import HybridKVError
from hybridkv.core.keys import block_hashes
from hybridkv.core.layout import GroupKind, Layout
from hybridkv.core.retention import AUTO, Retention, replay_boundary, resolve_interval
from hybridkv.ram.policies import CostAwareLRU, EvictionPolicy
from hybridkv.ram.regions import PagelessRegion
from hybridkv.tools.shared_budget import shared_pools_for
from hybridkv.tools.traces import read_trace, write_mooncake
from hybridkv.tools.workloads import TRACE_BLOCK, TRACE_WORKLOADS, WORKLOADS

# Prefill compute model of the default layout's model (Qwen3-Next-80B-A3B): 2 FLOPs per
# active parameter per token, plus attention's score and value products over the prefix
# (4 x 12 full-attention layers x 16 query heads x 256 dims per query-key pair).
LINEAR_FLOPS = 2 * 3.0e9
PAIR_FLOPS = 4 * 12 * 16 * 256


def prefill_flops(lo: int, hi: int) -> float:
    """FLOPs to compute prompt positions [lo, hi) with [0, lo) already cached."""
    return (hi - lo) * LINEAR_FLOPS + PAIR_FLOPS * (hi * hi - lo * lo) / 2


class PromptEndOnly(Retention):
    """vLLM's own hybrid caching: one state at each prompt's replay boundary, no junctions."""

    def keeps(self, boundary: int, n_tokens: int, junction: int | None = None) -> bool:
        return super().keeps(boundary, n_tokens, None)


@dataclass(frozen=True)
class Policy:
    """``retention``: dense (None), 0 (semantic), an interval or ``auto`` (the default's, about
    16K tokens, resolved against the layout's block); ``junctions``: keep a state
    where attention reached deeper than any state; ``eviction``: lru, arc or ``flop`` (recency
    weighed against recompute FLOPs saved per byte, ``alpha`` the weight); ``states=False``
    makes state pages cost nothing (the attention-only ceiling); ``align``: where each
    prompt's own state sits (0: its replay boundary, None: learned from the traffic);
    ``insertion``: where new pages enter the eviction order (warm: plain LRU, cold, or
    adaptive: learned from the traffic); ``spare``: also store the states it does not keep
    while RAM has room for them (cold, evicting nothing); ``ram_split``: shared (attention
    pages and states draw on one arena) or static (as planned for the reference prompt)."""

    name: str
    retention: int | str | None = 0
    junctions: bool = True
    eviction: str = "lru"
    alpha: float = 0.0
    states: bool = True
    tail: int = 0
    align: int | None = 0
    insertion: str = "warm"
    spare: bool = False
    ram_split: str = "shared"

    def interval(self, block_tokens: int) -> int | None:
        return resolve_interval(self.retention, block_tokens)

    def keeper(self, block_tokens: int) -> Retention:
        kind = Retention if self.junctions else PromptEndOnly
        return kind(block_tokens, self.interval(block_tokens), self.tail, self.align or 0)


RECOMMENDED = "aligned-periodic"
POLICY_NAMES = ("dense", "vllm-align", "semantic", "semantic-tail", "semantic-aligned", "periodic-N",
                "aligned-periodic", "aligned-periodic-N", "marconi")


def policy(name: str) -> Policy:
    """A named policy: dense, vllm-align, semantic, semantic-tail, semantic-aligned,
    periodic-N (N tokens), aligned-periodic-N (semantic-aligned plus a state every N),
    aligned-periodic (hybridkv's default: N about 16K tokens) or marconi."""
    if name == "dense":
        return Policy(name, retention=None)
    if name == "vllm-align":
        return Policy(name, junctions=False)
    if name == "semantic":
        return Policy(name)
    if name == "semantic-tail":       # semantic plus the state a block before the end
        return Policy(name, tail=1)
    if name == "semantic-aligned":    # semantic-tail until it learns where prompts diverge
        return Policy(name, tail=1, align=None)
    if name == "aligned-periodic":    # hybridkv's default
        return Policy(name, retention=AUTO, tail=1, align=None, insertion="adaptive", spare=True)
    if name == "marconi":     # branch-point states (junctions) and FLOP-aware eviction
        return Policy(name, eviction="flop", alpha=1.0)
    for prefix, base in (("periodic-", "semantic"), ("aligned-periodic-", "semantic-aligned")):
        interval = name[len(prefix):]
        if name.startswith(prefix) and interval.isdigit() and int(interval) > 0:
            return dataclasses.replace(policy(base), name=name, retention=int(interval))
    raise HybridKVError(f"policy {name!r} is unknown; use {', '.join(POLICY_NAMES)} (e.g. periodic-4096)")


def settings(pol: Policy) -> dict | None:
    """The cache settings that keep what ``pol`` keeps (a config file's keys), or None where
    no setting does: ``vllm-align`` keeps no junctions, ``marconi`` evicts by FLOPs saved."""
    if not pol.junctions or pol.eviction == "flop" or not pol.states:
        return None
    return {"retention": "dense" if pol.retention is None else pol.retention, "tail_states": pol.tail,
            "state_align": "auto" if pol.align is None else pol.align, "eviction": pol.eviction,
            "insertion": pol.insertion, "spare_states": pol.spare, "ram_split": pol.ram_split}


def attention_only(layout: Layout) -> Layout:
    """The layout with its state groups removed: what a cache whose states cost nothing holds."""
    return dataclasses.replace(layout, groups=tuple(g for g in layout.groups if g.kind is not GroupKind.STATE))


class PrefixTruth:
    """Every prompt replayed so far as a tree of blocks keyed by their raw token bytes; how
    deep a new prompt's tokens were seen before is how deep any correct cache could serve it."""

    def __init__(self, block_tokens: int):
        self.B = block_tokens
        self.children: dict[tuple[int, int], int] = {}

    def servable_then_add(self, tokens: np.ndarray) -> int:
        """Tokens of ``tokens`` a correct hit may restore (up to its replay boundary), then
        record the prompt."""
        B, children = self.B, self.children
        raw = np.ascontiguousarray(tokens, dtype=np.int64).tobytes()
        step, node, seen = B * 8, 0, 0
        for i in range(len(tokens) // B):
            edge = (node, hash(raw[i * step:(i + 1) * step]))
            nxt = children.get(edge)
            if nxt is None:
                nxt = children[edge] = len(children) + 1
            else:      # after the first new block every later one is new too
                seen = i + 1
            node = nxt
        return min(seen * B, replay_boundary(len(tokens), B))


def clairvoyant_states(prompts: Sequence[np.ndarray], block_tokens: int) -> type[Connector]:
    """A connector that stores a state exactly where a later prompt of ``prompts`` resumes (the
    deepest block it shares with the prompts before it) and nowhere else: perfect knowledge of
    which states will be used. Replayed with any policy it tells what a better choice of states
    could gain on this trace; not a strict bound, since eviction still decides what stays (and
    a learned insertion still learns from shadows that replay the policy's own states)."""
    truth, resumed = PrefixTruth(block_tokens), set()
    for tokens in prompts:
        depth = truth.servable_then_add(tokens)
        if depth:
            resumed.add(block_hashes(tokens, block_tokens)[depth // block_tokens - 1])

    class ClairvoyantStates(Connector):
        def wants_state(self, req, boundary: int) -> bool:
            return not self._over_cap(req, boundary) and req.keys[boundary // self.B - 1] in resumed

        def is_spare(self, req, kind, position: int) -> bool:
            return False

    return ClairvoyantStates


@dataclass
class SimResult:
    policy: str
    workload: str
    budget_bytes: int
    requests: int
    prompt_tokens: int
    prefill_tokens_saved: int
    flops_saved: float
    servable_tokens: int          # what unlimited memory and every state could have restored
    wrong_hits: int
    ram_bytes_stored: int
    ram_bytes_loaded: int
    state_align_tokens: int = 0   # where prompts' own states were kept at the end (learned, or the policy's)
    reference_tokens: int = 0     # the prompt length RAM was planned for at the end (given, or learned)

    @property
    def token_hit_rate(self) -> float:
        return self.prefill_tokens_saved / max(1, self.prompt_tokens)

    @property
    def unlimited_rate(self) -> float:
        return self.servable_tokens / max(1, self.prompt_tokens)

    @property
    def bytes_per_hit_token(self) -> float:
        return self.ram_bytes_stored / max(1, self.prefill_tokens_saved)

    def to_dict(self) -> dict:
        return {**vars(self), "token_hit_rate": self.token_hit_rate,
                "bytes_per_hit_token": self.bytes_per_hit_token}


def _cost_aware(layout: Layout, costs: dict[bool, dict], alpha: float) -> Callable[[int, int], EvictionPolicy]:
    """Pools whose policy weighs each key's cost per byte: ``costs[True]`` for the state
    groups' keys, ``costs[False]`` for the token groups' (every group of a kind shares one)."""
    def make(gid: int, capacity: int) -> EvictionPolicy:
        return CostAwareLRU(capacity, costs[layout.group(gid).kind is GroupKind.STATE].get, alpha)
    return make


def replay(layout: Layout, requests: Sequence[np.ndarray] | Iterable[np.ndarray], budget_bytes: int,
           pol: Policy, workload: str = "", reference_tokens: int | None = 8192,
           connector: type[Connector] = Connector, progress: bool = False,
           shared_budget: bool = False) -> SimResult:
    """Replay prompts (token id arrays) through the real ``Connector`` over a pageless
    ``TieredCache`` planned from ``budget_bytes``, offering what an engine offers at each block
    end, and check every hit against ``PrefixTruth``. ``reference_tokens=None`` plans RAM as a
    cache not told the prompt length does (for the model's longest, then learned);
    ``shared_budget``: every group draws on one budget in one LRU order, with no segments
    (``SharedBudgetPools``, the bound of the arena ``pol.ram_split`` shares)."""
    if not pol.states:
        layout = attention_only(layout)
    B = layout.block_tokens
    config = CacheConfig(block_tokens=B, ram_bytes=budget_bytes, eviction="lru" if pol.eviction == "flop"
                         else pol.eviction, retention=pol.retention, tail_states=pol.tail, state_align=pol.align,
                         reference_tokens=reference_tokens, insertion=pol.insertion,
                         spare_states=pol.spare, ram_split=pol.ram_split)
    flop_aware = pol.eviction == "flop"
    block_cost, state_cost = {}, {}      # key -> recompute FLOPs its page saves, per byte
    if shared_budget and pol.eviction != "lru":
        raise HybridKVError(f"the shared-budget bound keeps one LRU order; it does not apply to eviction {pol.eviction!r}")
    cache = TieredCache(layout, config, secondaries=[], pageless=True,
                        eviction=_cost_aware(layout, {False: block_cost, True: state_cost}, pol.alpha)
                        if flop_aware else None,
                        pools=shared_pools_for(budget_bytes, layout)
                        if shared_budget else None)
    conn = connector(cache, None if pol.align is None else pol.keeper(B))     # None: it learns
    token_pages = dict.fromkeys(conn.token_groups, PagelessRegion.EMPTY)
    state_pages = dict.fromkeys(conn.state_groups, PagelessRegion.EMPTY)
    token_bytes, state_bytes = layout.block_bytes, layout.state_bytes
    truth = PrefixTruth(B)
    n = prompt = saved = servable = wrong = 0
    flops = 0.0
    try:
        for tokens in tqdm(requests, desc=f"{pol.name} {budget_bytes / 2**30:g} GiB", unit="req",
                           disable=not progress, leave=False):
            req = conn.begin(f"sim-{n}", tokens)
            n += 1
            prompt += len(tokens)
            could = truth.servable_then_add(tokens)
            servable += could
            hit = 0
            if req.hit_tokens and conn.load(req) is not None:
                hit = req.hit_tokens
                conn.release(req)
                flops += prefill_flops(0, hit)
            if hit > could:
                wrong += 1
            saved += hit
            last_state = hit
            for boundary in range(hit + B, len(tokens) + 1, B):
                block = boundary // B - 1
                if token_pages and conn.wants_block(req, block):
                    if flop_aware:
                        block_cost[req.keys[block]] = prefill_flops(boundary - B, boundary) / token_bytes
                    conn.offer_block(req, block, token_pages)
                if state_pages and conn.wants_state(req, boundary):
                    if flop_aware:
                        state_cost[req.keys[block]] = prefill_flops(last_state, boundary) / state_bytes
                    last_state = boundary
                    conn.offer_state(req, boundary, state_pages)
            conn.finish(req)
        ram = cache.stats()["tiers"][RAM]
        return SimResult(pol.name, workload, budget_bytes, n, prompt, saved, flops, servable, wrong,
                         ram["bytes_in"], ram["bytes_out"], pol.align or conn.stats["state_align_tokens"],
                         cache.plan.reference_tokens)
    finally:
        cache.close()


def workload_prompts(name: str, **sizes) -> list[np.ndarray]:
    """A built-in workload's prompts as token id arrays (``sizes``: its generator's arguments).
    A generated trace goes through the Mooncake file format users give, so what it measures
    includes reading a trace."""
    if name in WORKLOADS:
        return [np.asarray(t, dtype=np.int64) for t in WORKLOADS[name](**sizes)]
    if name in TRACE_WORKLOADS:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{name}.jsonl"
            write_mooncake(path, TRACE_WORKLOADS[name](**sizes), TRACE_BLOCK)
            return [r.tokens for r in read_trace(path, "mooncake", TRACE_BLOCK)]
    raise HybridKVError(f"workload {name!r} is unknown; use one of {', '.join([*WORKLOADS, *TRACE_WORKLOADS])}, "
                        "or give a trace")


def reference_tokens(prompts: Sequence[np.ndarray], block_tokens: int) -> int:
    """What the pools are planned for by default: the mean prompt, in whole blocks."""
    return max(block_tokens, int(np.mean([len(p) for p in prompts])) // block_tokens * block_tokens)
