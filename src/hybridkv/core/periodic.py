"""Whether periodic states pay for their bytes on the traffic at hand, learned while serving.

A state every ~16K tokens (``retention = auto``) serves long sessions that branch inside an
earlier turn, where neither the prompt's own state nor a junction lies. Where sessions only
come back at their ends, the same states are bytes that evict pages a later turn needs:
replaying a public multi-turn set they raised the hit rate at 512 GiB from 57.9% to 62.5%;
replaying a public chat hour they lowered it at 32 GiB from 7.5% to 6.7%. Which holds is
measured while serving: two shadows of RAM, one keeping them and one not, replay every
request under the insertion in force, and the one that restored more over the last ~10,000
requests decides (as ``Insertion`` decides where pages enter).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hybridkv.core.insertion import DECAY
from hybridkv.core.retention import Retention
from hybridkv.core.shadow import Shadow, pair_hits, stores


class PeriodicChoice:
    """``shadows``: RAM's keys with and without the states every ``interval`` tokens;
    ``score``: carried over from the choice this one replaces (a re-plan or reset changes
    RAM, not the traffic)."""

    def __init__(self, block_tokens: int, interval: int, shadows: tuple[Shadow, Shadow], score: float = 0.0):
        self.B, self.interval, self.shadows = block_tokens, interval, shadows
        self.score = score        # > 0: the shadow without periodic states restored more lately

    @property
    def keeps_periodic(self) -> bool:
        return self.score <= 0

    @property
    def interval_now(self) -> int:
        """The retention interval in force: ``interval``, or 0 (prompt states and junctions)."""
        return self.interval if self.keeps_periodic else 0

    def begin(self, keys: Sequence[bytes], n_tokens: int) -> tuple[int, int]:
        """Blocks each shadow restores for this prompt (with, without periodic states)."""
        return pair_hits(self.shadows, keys, n_tokens, self.B)

    def finished(self, keys: Sequence[bytes], n_tokens: int, hits: tuple[int, int], retention: Retention,
                 junction: int | None, cold: bool, stored_tokens: int | None = None,
                 spare_boundaries: Sequence[int] | None = None) -> None:
        """The request ran to its end under ``retention``, its stores entering cold or not:
        each shadow stores what that retention would have with its interval (and, where
        ``spare_boundaries`` is given, the spare states the engine had into free room), up to
        ``stored_tokens``; the score weighs what the two restored."""
        B, lowest = self.B, min(hits)
        # the engine had a state wherever the retention in force kept one or it offered a spare
        had = () if spare_boundaries is None else {*spare_boundaries, *(
            b for b in range(B * (lowest + 1), n_tokens + 1, B) if retention.keeps(b, n_tokens, junction))}
        for shadow, hit, interval in zip(self.shadows, hits, (self.interval, 0), strict=True):
            keeper = dataclasses.replace(retention, interval=interval)
            full, ends, spare_ends = stores(keys, n_tokens, B, lowest, keeper, junction, stored_tokens, had)
            shadow.record(full, hit, ends, cold, spare_ends)
        self.score = DECAY * self.score + (hits[1] - hits[0]) * B
