"""Replays synthetic traffic through the real connector and cache — no model, no page bytes.

Each request is only token ids: the ``Connector`` keys it, finds its hybrid hit, pins and
releases the hit's pages and takes the offers a real engine makes (every full block, the
states retention keeps) into a ``TieredCache`` whose regions hold no bytes. What comes out is what a user chooses a
cache by: token hit rate, prefill tokens saved, bytes moved. The workloads follow the published
ones (multi-turn chat, a shared system prompt, long-document QA, agentic sessions).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hybridkv.cache import RAM, TieredCache
from hybridkv.config import CacheConfig
from hybridkv.connector import Connector
from hybridkv.core.layout import Layout
from hybridkv.ram.regions import PagelessRegion


class _Tokens:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def __call__(self, lo: int, hi: int | None = None) -> list[int]:
        n = lo if hi is None else int(self.rng.integers(lo, hi + 1))
        return self.rng.integers(3, 150_000, n).tolist()


def multi_turn_chat(users=24, turns=6, seed=0) -> Iterator[list[int]]:
    """Each turn = previous prompt + answer + new message; users interleave."""
    t = _Tokens(seed)
    history = [t(300, 1200) for _ in range(users)]
    for _ in range(turns):
        for u in range(users):
            history[u] = history[u] + t(200, 600)       # the new user message
            yield history[u]
            history[u] = history[u] + t(100, 400)       # the answer joins the history


def shared_system_prompt(users=160, system_prompts=3, seed=1) -> Iterator[list[int]]:
    """Many users behind a few long system prompts, each with one short question."""
    t = _Tokens(seed)
    systems = [t(3000, 6000) for _ in range(system_prompts)]
    rng = np.random.default_rng(seed + 100)
    for _ in range(users):
        yield systems[int(rng.integers(system_prompts))] + t(50, 300)


def document_qa(documents=12, questions=6, seed=2) -> Iterator[list[int]]:
    """Long documents asked several questions each, documents interleaved in pairs."""
    t = _Tokens(seed)
    docs = [t(8000, 16000) for _ in range(documents)]
    for pair in range(0, documents, 2):
        for _ in range(questions):
            for d in (pair, pair + 1):
                if d < documents:
                    yield docs[d] + t(30, 120)


def agentic(sessions=16, steps=8, seed=3) -> Iterator[list[int]]:
    """Sessions sharing a tool schema; each step appends a tool call and its result."""
    t = _Tokens(seed)
    tools = t(4000)
    trajectories = [tools + t(200, 800) for _ in range(sessions)]
    for _ in range(steps):
        for s in range(sessions):
            yield trajectories[s]
            trajectories[s] = trajectories[s] + t(50, 200) + t(300, 1500)


WORKLOADS = {"multi_turn_chat": multi_turn_chat, "shared_system_prompt": shared_system_prompt,
             "document_qa": document_qa, "agentic": agentic}


@dataclass
class SimResult:
    workload: str
    retention: int | None
    eviction: str
    budget_bytes: int
    requests: int
    prompt_tokens: int
    prefill_tokens_saved: int
    ram_bytes_stored: int
    ram_bytes_loaded: int
    prefill_seconds_saved: float

    @property
    def token_hit_rate(self) -> float:
        return self.prefill_tokens_saved / max(1, self.prompt_tokens)

    def to_dict(self) -> dict:
        return {**vars(self), "token_hit_rate": self.token_hit_rate}


def prefill_seconds(tokens_from: int, tokens_to: int, per_token_s: float, per_token_sq_s: float) -> float:
    """Compute-cost model: linear work plus attention's quadratic term over the computed span."""
    n = tokens_to - tokens_from
    return n * per_token_s + per_token_sq_s * (tokens_to**2 - tokens_from**2) / 2


def simulate(layout: Layout, workload: str, budget_bytes: int, retention: int | None = 0,
             eviction: str = "lru", reference_tokens: int = 8192, scale: float = 1.0,
             per_token_s: float = 2e-4, per_token_sq_s: float = 2e-9) -> SimResult:
    """Replay one workload through the real ``Connector`` over a pageless ``TieredCache``
    planned from ``budget_bytes``, offering what the reference engine offers at each block end."""
    B = layout.block_tokens
    config = CacheConfig(block_tokens=B, ram_bytes=budget_bytes, eviction=eviction,
                         retention=retention, reference_tokens=reference_tokens)
    cache = TieredCache(layout, config, secondaries=[], pageless=True)
    conn = Connector(cache)
    token_pages = dict.fromkeys(conn.token_groups, PagelessRegion.EMPTY)
    state_pages = dict.fromkeys(conn.state_groups, PagelessRegion.EMPTY)
    sizes = {"users": 24, "turns": 6} if workload == "multi_turn_chat" else {}
    gen = WORKLOADS[workload](**{k: max(1, int(v * scale)) for k, v in sizes.items()})
    requests = prompt_tokens = 0
    seconds_saved = 0.0
    try:
        for tokens in gen:
            req = conn.begin(f"sim-{requests}", tokens)
            requests += 1
            prompt_tokens += len(tokens)
            hit = 0
            if req.hit_tokens and conn.load(req) is not None:
                hit = req.hit_tokens
                conn.release(req)
                seconds_saved += prefill_seconds(0, hit, per_token_s, per_token_sq_s)
            for boundary in range(hit + B, len(tokens) + 1, B):
                if token_pages and conn.wants_block(req, boundary // B - 1):
                    conn.offer_block(req, boundary // B - 1, token_pages)
                if conn.wants_state(req, boundary):
                    conn.offer_state(req, boundary, state_pages)
            conn.finish(req)
        ram = cache.counters[RAM]
        return SimResult(workload, retention, eviction, budget_bytes, requests, prompt_tokens,
                         conn.stats["hit_tokens"], ram.bytes_in, ram.bytes_out, seconds_saved)
    finally:
        cache.close()
