"""Synthetic traffic for the simulator: token workloads and Mooncake-format traces.

The token workloads follow the published ones (multi-turn chat, a shared system prompt, long
document QA, agentic sessions). The trace generators write the same kinds of traffic as hash-id
lists (one id per block of ``TRACE_BLOCK`` tokens, the last block partial, as production traces
record them), at any size, so a policy is judged on more than the two public traces.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count

import numpy as np

TRACE_BLOCK = 512


class TokenSource:
    """Seeded random token ids: ``t(n)`` gives n of them, ``t(lo, hi)`` a random count in [lo, hi]."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def __call__(self, lo: int, hi: int | None = None) -> list[int]:
        n = lo if hi is None else int(self.rng.integers(lo, hi + 1))
        return self.rng.integers(3, 150_000, n).tolist()


def multi_turn_chat(users=24, turns=6, seed=0) -> Iterator[list[int]]:
    """Each turn = previous prompt + answer + new message; users interleave."""
    t = TokenSource(seed)
    history = [t(300, 1200) for _ in range(users)]
    for _ in range(turns):
        for u in range(users):
            history[u] = history[u] + t(200, 600)       # the new user message
            yield history[u]
            history[u] = history[u] + t(100, 400)       # the answer joins the history


def shared_system_prompt(users=160, system_prompts=3, seed=1) -> Iterator[list[int]]:
    """Many users behind a few long system prompts, each with one short question."""
    t = TokenSource(seed)
    systems = [t(3000, 6000) for _ in range(system_prompts)]
    rng = np.random.default_rng(seed + 100)
    for _ in range(users):
        yield systems[int(rng.integers(system_prompts))] + t(50, 300)


def document_qa(documents=12, questions=6, seed=2) -> Iterator[list[int]]:
    """Long documents asked several questions each, documents interleaved in pairs."""
    t = TokenSource(seed)
    docs = [t(8000, 16000) for _ in range(documents)]
    for pair in range(0, documents, 2):
        for _ in range(questions):
            for d in (pair, pair + 1):
                if d < documents:
                    yield docs[d] + t(30, 120)


def agentic(sessions=16, steps=8, seed=3) -> Iterator[list[int]]:
    """Sessions sharing a tool schema; each step appends a tool call and its result."""
    t = TokenSource(seed)
    tools = t(4000)
    trajectories = [tools + t(200, 800) for _ in range(sessions)]
    for _ in range(steps):
        for s in range(sessions):
            yield trajectories[s]
            trajectories[s] = trajectories[s] + t(50, 200) + t(300, 1500)


WORKLOADS = {"multi_turn_chat": multi_turn_chat, "shared_system_prompt": shared_system_prompt,
             "document_qa": document_qa, "agentic": agentic}


TraceLine = tuple[list[int], int]      # (hash ids, input_length)


class _Ids:
    """Fresh hash ids and the partial last block every prompt ends with."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.fresh = count()

    def new(self, lo: int, hi: int) -> list[int]:
        return [next(self.fresh) for _ in range(int(self.rng.integers(lo, hi + 1)))]

    def prompt(self, ids: list[int]) -> TraceLine:
        """``ids`` plus a partial block of fresh tokens (the request's own tail)."""
        tail = int(self.rng.integers(16, TRACE_BLOCK))
        return ids + [next(self.fresh)], len(ids) * TRACE_BLOCK + tail


def system_prompt_trace(requests: int = 2000, prompts: int = 12, seed: int = 10) -> Iterator[TraceLine]:
    """Users behind a few long system prompts of Zipf-like popularity, one question each."""
    ids = _Ids(seed)
    systems = [ids.new(4, 24) for _ in range(prompts)]
    weights = 1.0 / np.arange(1, prompts + 1)
    picks = ids.rng.choice(prompts, size=requests, p=weights / weights.sum())
    for p in picks:
        yield ids.prompt(systems[p] + ids.new(0, 2))


def multi_turn_trace(sessions: int = 300, turns: int = 6, active: int = 40, seed: int = 11) -> Iterator[TraceLine]:
    """Chat sessions, ``active`` at a time in random order: each turn re-sends the history (its
    full blocks) with the answer and a new message appended."""
    ids = _Ids(seed)
    history: dict[int, list[int]] = {}
    left: dict[int, int] = {}
    started = 0
    while history or started < sessions:
        while len(history) < active and started < sessions:
            history[started], left[started] = ids.new(1, 8), int(ids.rng.integers(1, turns + 1))
            started += 1
        s = list(history)[int(ids.rng.integers(len(history)))]
        yield ids.prompt(history[s])
        left[s] -= 1
        if left[s] == 0:
            del history[s], left[s]
        else:
            history[s] = history[s] + ids.new(1, 3)


def agent_trace(sessions: int = 120, steps: int = 10, seed: int = 12) -> Iterator[TraceLine]:
    """Agent sessions behind one tool schema; each step appends a call and its result, and one
    step in four retries from an earlier point (a branch: two continuations of one prefix)."""
    ids = _Ids(seed)
    schema = ids.new(8, 8)
    paths = {s: schema + ids.new(1, 2) for s in range(sessions)}
    for _ in range(steps):
        for s in range(sessions):
            yield ids.prompt(paths[s])
            if ids.rng.random() < 0.25 and len(paths[s]) > len(schema) + 2:
                paths[s] = paths[s][:-2]           # back off two blocks and try again
            paths[s] = paths[s] + ids.new(1, 4)


def mixed_trace(requests: int = 12_000, seed: int = 13) -> Iterator[TraceLine]:
    """All three kinds interleaved, ``requests`` in all (the large generated trace)."""
    rng = np.random.default_rng(seed)
    sources = [system_prompt_trace(requests, seed=seed), multi_turn_trace(requests, seed=seed + 1),
               agent_trace(300, 20, seed=seed + 2)]
    for _ in range(requests):
        pick = int(rng.choice(3, p=(0.3, 0.45, 0.25)))
        ids, length = next(sources[pick])
        yield [i * 3 + pick for i in ids], length       # ids of different sources never meet


TRACE_WORKLOADS = {"system_prompts": system_prompt_trace, "multi_turn": multi_turn_trace,
                   "agent_branches": agent_trace, "mixed_12k": mixed_trace}
