"""Copying the pages an arena move relocates, on a few threads at once.

When the arena gives a unit of segments to the other kind, the idle pages still in those
segments move to free slots the giving groups keep (``GroupedPools.take_relocated``). The
copy must be done before the store that asked for the room goes on, so it runs on the
cache's thread: under vLLM, the scheduler's. On the public chat hour at 128 GiB a move copies
about 394 MiB: 75 ms on one core of the 2-core machine the benchmarks ran on, 45 ms on two.
One core's copy stops at what that core can pull through memory, short of what the memory
can give (a page at a time, it also misses the streaming stores one big memcpy gets); the pages of one move are
disjoint (each goes from a given-away segment to a slot the giver keeps, and no two share
either), so a few threads copy them at once, numpy letting go of the GIL while it copies.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

# Enough to reach most of a server's memory bandwidth from one process, few enough to leave
# the engine's own threads their cores for the milliseconds a move takes.
THREADS = min(4, os.cpu_count() or 1)
# Below this, handing pages to threads costs about what it saves: one thread copies.
PARALLEL_BYTES = 16 * 1024 * 1024


class Rows(Protocol):
    array: np.ndarray       # one row per slot


class Relocator:
    """Copies ``(region, from row, to row)`` triples; ``copy`` returns once all are done.
    ``threads`` and ``parallel_bytes`` default to the module's ``THREADS`` and ``PARALLEL_BYTES``."""

    def __init__(self, threads: int | None = None, parallel_bytes: int | None = None):
        self.threads = THREADS if threads is None else threads
        self.parallel_bytes = PARALLEL_BYTES if parallel_bytes is None else parallel_bytes
        self._pool: ThreadPoolExecutor | None = None     # made at the first move that needs it

    def copy(self, moves: Sequence[tuple[Rows, int, int]]) -> None:
        nbytes = sum(region.array[0].nbytes for region, _, _ in moves)
        if self.threads < 2 or nbytes < self.parallel_bytes or len(moves) < 2:
            for move in moves:
                _copy_one(move)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="hybridkv-relocate")
        for _ in self._pool.map(_copy_one, moves):   # re-raises a copy's error here
            pass

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _copy_one(move: tuple[Rows, int, int]) -> None:
    region, src, dst = move
    region.array[dst] = region.array[src]
