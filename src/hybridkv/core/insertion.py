"""Where a request's new pages enter RAM's eviction order, chosen from the traffic itself.

LRU puts every new page at the warm end. When sessions come back in a cycle longer than RAM
holds (many users taking turns, agents stepping round-robin), LRU evicts each page shortly
before its reuse and restores almost nothing. Storing the pages of a request that found little
of itself cached at the cold end instead (one request in ``WARM_EVERY`` still warm, so a new
working set can enter) keeps part of the cycle whole; on traffic whose reuse fits, it evicts
pages LRU would have served. Which serves better is measured while serving: two shadow caches
of keys alone, as large as the RAM pools, replay every request's hybrid hit under each
insertion, and the one that restored more over the last ~10,000 requests decides (the dynamic
insertion policy of Qureshi et al., ISCA 2007, over whole requests, with the hybrid hit rule).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.core.errors import HybridKVError
from hybridkv.core.retention import Retention
from hybridkv.core.shadow import ShadowCache, pair_hits, stores

MODES = ("adaptive", "warm", "cold")
WARM_EVERY = 32           # one request in 32 (drawn) enters warm whatever it hit
WARM_HIT_SHARE = 0.5      # a request that found this share of its prompt cached is reuse
# The score's memory: about the last 10,000 requests. A short memory (100 or 1,000 requests)
# switched with every phase of mixed traffic and lost to both insertions held steady (the
# generated mix at 128 GiB: 65.3% / 65.6% against 67.6% for either): what one shadow gains
# over a phase the real cache, holding the other insertion's pages, does not.
DECAY = 0.9999


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise HybridKVError(f"insertion = {mode!r} is unknown; use adaptive (the default), warm (plain LRU) "
                            "or cold (pages of requests that found under half their prompt enter cold)")
    return mode


@dataclass(frozen=True)
class Ticket:
    """What ``Insertion.begin`` decided for one request: ``cold`` for its stores; the blocks
    the warm and the cold shadow restore for it; whether the cold shadow stores it warm; the
    ``Insertion`` that issued it (a ticket from before a reset teaches the new one nothing)."""

    cold: bool
    warm_hit: int = 0
    cold_hit: int = 0
    cold_shadow_warm: bool = True
    issuer: int = 0


class Insertion:
    """Decides per request whether its stores enter cold (``begin``) and learns from what it
    would have restored under either insertion (``finished``). ``state_slots`` None: a model
    without recurrent state; ``score``: carried over from the insertion this one replaces (the
    traffic did not change when RAM was re-planned or reset)."""

    _issued = itertools.count(1)

    def __init__(self, mode: str, block_tokens: int, block_slots: int, state_slots: int | None,
                 score: float = 0.0):
        self.mode = check_mode(mode)
        self.B = block_tokens
        self.score = score        # > 0: the cold insertion restored more lately
        self.shadows = ((ShadowCache(block_slots, state_slots), ShadowCache(block_slots, state_slots))
                        if mode == "adaptive" else None)
        self._id = next(self._issued)
        # A request's warm turn is drawn, not counted: with a count, users taking turns in a
        # cycle whose length is a multiple of WARM_EVERY would always give it to the same users.
        # A fixed seed: a replay's result does not depend on what ran before it.
        self._draw = random.Random(0)

    def resize(self, block_slots: int, state_slots: int | None) -> None:
        """RAM was re-planned without losing its pages: the shadows keep theirs, at the new sizes."""
        for shadow in self.shadows or ():
            shadow.resize(block_slots, state_slots)

    @property
    def prefers_cold(self) -> bool:
        return self.mode == "cold" or (self.mode == "adaptive" and self.score > 0)

    def begin(self, keys: Sequence[bytes], n_tokens: int, hit_tokens: int) -> Ticket:
        if self.mode == "warm":           # plain LRU: nothing to draw or replay
            return Ticket(False, issuer=self._id)
        lucky = self._draw.random() * WARM_EVERY < 1

        def warm(hit: int) -> bool:
            return lucky or (hit > 0 and hit >= WARM_HIT_SHARE * n_tokens)

        cold = self.prefers_cold and not warm(hit_tokens)
        if self.shadows is None:
            return Ticket(cold, issuer=self._id)
        warm_hit, cold_hit = pair_hits(self.shadows, keys, n_tokens, self.B)
        return Ticket(cold, warm_hit, cold_hit, warm(cold_hit * self.B), self._id)

    def finished(self, keys: Sequence[bytes], n_tokens: int, ticket: Ticket, retention: Retention,
                 junction: int | None, stored_tokens: int | None = None,
                 spare_boundaries: Sequence[int] = ()) -> None:
        """The request ran to its end: each shadow stores what it would have (the blocks past its
        hit, the states ``retention`` keeps and, into free room, the spare states the engine had
        at ``spare_boundaries``, up to ``stored_tokens`` where the engine caps what a request
        stores), and the score weighs what the two restored."""
        if self.shadows is None or ticket.issuer != self._id:
            return
        full, ends, spare_ends = stores(keys, n_tokens, self.B, min(ticket.warm_hit, ticket.cold_hit), retention,
                                        junction, stored_tokens, spare_boundaries)
        self.shadows[0].record(full, ticket.warm_hit, ends, False, spare_ends)
        self.shadows[1].record(full, ticket.cold_hit, ends, not ticket.cold_shadow_warm, spare_ends)
        self.score = DECAY * self.score + (ticket.cold_hit - ticket.warm_hit) * self.B
