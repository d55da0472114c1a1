"""Which recurrent states are kept, and how deep a prompt can be restored.

This module is the single place that decides hit lengths (how many prompt tokens every group
can restore together) and which boundaries keep a state; the connector and the simulator both
call it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import Group, GroupKind

AUTO = "auto"
DEFAULT_INTERVAL_TOKENS = 16384


def resolve_interval(retention: int | str | None, block_tokens: int) -> int | None:
    """``auto`` (the default retention): a state every ~16K tokens besides the prompt's own
    and the junctions, at the multiple of the block nearest 16,384. Replaying the public
    traces, that interval restored the most of 4K-32K (long sessions branch inside earlier
    turns, where a periodic state serves the second occurrence and a junction only the third)
    and changed nothing where prompts are shorter. Other values pass through."""
    if retention != AUTO:
        return retention
    return max(1, round(DEFAULT_INTERVAL_TOKENS / block_tokens)) * block_tokens


def replay_boundary(n_tokens: int, block_tokens: int) -> int:
    """Deepest boundary a repeat of the prompt can resume from (the last token is recomputed)."""
    return max(0, (n_tokens - 1) // block_tokens * block_tokens)


@dataclass(frozen=True)
class Retention:
    """``interval``: None = dense, 0 = semantic (prompt end + junctions), N = semantic + every N.
    ``align``: the prompt's own state sits at the deepest multiple of ``align`` tokens up to its
    replay boundary (0: the replay boundary itself), where follow-ups diverge when prompts
    share whole chunks of that size. ``tail``: states also kept at the ``tail`` boundaries just
    before that one, so a follow-up that shares the prompt except its last block (a chat
    template that re-renders the end of a turn) still finds a state."""

    block_tokens: int
    interval: int | None = 0
    tail: int = 0
    align: int = 0

    def __post_init__(self):
        if self.interval is not None and (self.interval < 0 or self.interval % self.block_tokens):
            raise HybridKVError(
                f"retention {self.interval} is not a multiple of the block size {self.block_tokens}; "
                f"use auto, 0, dense or e.g. {8 * self.block_tokens}"
            )
        if self.align < 0 or self.align % self.block_tokens:
            raise HybridKVError(f"state alignment {self.align} is not a multiple of the block size "
                                f"{self.block_tokens}; use auto or e.g. {2 * self.block_tokens}")

    @property
    def dense(self) -> bool:
        return self.interval is None

    def prompt_state(self, n_tokens: int) -> int:
        """The boundary of the state kept for the prompt itself (0: none)."""
        return self._aligned(replay_boundary(n_tokens, self.block_tokens))

    def _aligned(self, replay: int) -> int:
        return replay // self.align * self.align if self.align else replay

    def servable(self, boundary: int, n_tokens: int) -> bool:
        """Could a state at ``boundary`` serve a hit at all: on the block grid and not past the
        prompt's replay boundary (the most a hit restores)?"""
        B = self.block_tokens
        return 0 < boundary <= replay_boundary(n_tokens, B) and not boundary % B

    def keeps(self, boundary: int, n_tokens: int, junction: int | None = None) -> bool:
        """O(1): is a state kept at ``boundary`` for a prompt of ``n_tokens``?"""
        if not self.servable(boundary, n_tokens):
            return False
        B = self.block_tokens
        replay = replay_boundary(n_tokens, B)
        end = self._aligned(replay)
        if self.interval is None or boundary == junction or 0 <= end - boundary <= self.tail * B:
            return True
        return self.interval > 0 and boundary % self.interval == 0

    def states_per_prompt(self, n_tokens: int) -> int:
        """k(R): states kept for one prompt of R tokens without a junction."""
        B = self.block_tokens
        replay = replay_boundary(n_tokens, B)
        if replay <= 0:
            return 0
        if self.interval is None:
            return replay // B
        end = self._aligned(replay)
        own = 1 + min(self.tail, end // B - 1) if end else 0
        if self.interval == 0:
            return own
        periodic = replay // self.interval
        return periodic + own - (1 if end and end % self.interval == 0 else 0)


class DivergenceAlignment:
    """Learns where prompts part ways, to keep each prompt's state where a follow-up resumes.

    A follow-up restores from the deepest state at or before the point where its tokens leave
    the cached ones (or its replay boundary, when every token it may restore is cached). When
    traffic shares whole chunks (a trace recorded in 512-token hash blocks; an engine that
    caches whole chunks), that point is a multiple of the chunk, and one state at the deepest
    multiple serves the follow-ups a state at the replay boundary plus tail states would: half
    the state bytes. ``observe`` takes how deep a prompt's attention pages matched and its
    replay boundary; ``align`` is the largest power-of-two multiple of the block that at least
    ``share`` of the recent points fall on (it falls back below ``share - 0.05``, so traffic
    near the threshold does not flip it), or the block itself until ``min_samples`` points at
    ``min_distinct`` different depths were seen: one shared preamble says nothing about chunks."""

    def __init__(self, block_tokens: int, max_blocks: int = 64, min_samples: int = 64,
                 share: float = 0.95, window: int = 4096, min_distinct: int = 8):
        self.B, self.levels = block_tokens, max_blocks.bit_length() - 1
        self.min_samples, self.share, self.window = min_samples, share, window
        self.min_distinct = min_distinct
        self.counts = [0] * (self.levels + 1)      # points on a multiple of B * 2**level
        self.seen = 0
        self.depths: set[int] = set()              # distinct points, up to min_distinct
        self.level = 0

    def observe(self, matched: int, replay: int) -> bool:
        """Record one prompt; True when ``align`` changed."""
        if matched <= 0:
            return False
        if self.seen >= self.window:        # forget evenly so the estimate follows the traffic
            self.counts = [c // 2 for c in self.counts]
            self.seen //= 2
        blocks = min(matched, replay) // self.B
        for level in range(self.levels + 1):
            if blocks % (1 << level):
                break
            self.counts[level] += 1
        self.seen += 1
        if len(self.depths) < self.min_distinct:
            self.depths.add(blocks)
        before, self.level = self.level, self._level()
        return self.level != before

    def _level(self) -> int:
        if self.seen < self.min_samples or len(self.depths) < self.min_distinct:
            return 0
        holds = self.level and self.counts[self.level] >= (self.share - 0.05) * self.seen
        if holds and (self.level == self.levels or self.counts[self.level + 1] < self.share * self.seen):
            return self.level
        return max(lv for lv in range(self.levels + 1) if self.counts[lv] >= self.share * self.seen)

    @property
    def align(self) -> int:
        return self.B << self.level


@dataclass(frozen=True)
class Hit:
    """``tokens``: restorable prefix; ``attention_tokens``: how deep token groups alone reach;
    ``junction``: set when attention reaches deeper than any stored state (store a state there)."""

    tokens: int
    attention_tokens: int
    junction: int | None


Present = Callable[[int, int], bool]   # (group id, block index) -> is the page there?


def _deepest_state(gid: int, candidate_blocks: int, present: Present) -> int:
    """Deepest block count c <= candidate with the state at boundary c (key of block c-1)."""
    c = candidate_blocks
    while c > 0 and not present(gid, c - 1):
        c -= 1
    return c


def _deepest_window(gid: int, window_blocks: int, candidate_blocks: int, present: Present) -> int:
    """Deepest c <= candidate whose last ``window_blocks`` blocks are all present."""
    c = candidate_blocks
    while c > 0:
        missing = next((i for i in range(c - 1, max(0, c - window_blocks) - 1, -1)
                        if not present(gid, i)), None)
        if missing is None:
            return c
        c = missing
    return 0


def _fixed_point(groups: Sequence[Group], cap_blocks: int, B: int, present: Present) -> int:
    c = cap_blocks
    for g in groups:
        if g.kind is GroupKind.ATTENTION:
            prefix = 0
            while prefix < c and present(g.id, prefix):
                prefix += 1
            c = prefix
    while True:
        before = c
        for g in groups:
            if g.kind is GroupKind.SLIDING_WINDOW:
                c = _deepest_window(g.id, -(-g.window_tokens // B), c, present)
            elif g.kind is GroupKind.STATE:
                c = _deepest_state(g.id, c, present)
        if c == before:
            return c


def compute_hit(groups: Sequence[Group], n_tokens: int, block_tokens: int, present: Present) -> Hit:
    """The hybrid hit as a fixed point: the deepest boundary where every attention group holds
    every block before it, every sliding-window group its window and every state group a
    state there, capped at the replay boundary; and the junction, where attention alone
    reaches further."""
    cacheable = [g for g in groups if g.cacheable]
    cap = replay_boundary(n_tokens, block_tokens) // block_tokens
    hit = _fixed_point(cacheable, cap, block_tokens, present)
    token_groups = [g for g in cacheable if g.is_token_group]
    attention = _fixed_point(token_groups, cap, block_tokens, present) if token_groups else hit
    junction = attention * block_tokens if attention > hit else None
    return Hit(hit * block_tokens, attention * block_tokens, junction)
