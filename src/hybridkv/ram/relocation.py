"""Copying the pages an arena move relocates, on a few threads at once.

When the arena gives a unit of segments to the other kind, the idle pages still in those
segments move to free slots the giving groups keep (``GroupedPools.take_relocated``). The
copy must be done before the store that asked for the room goes on, so it runs on the
cache's thread: under vLLM, the scheduler's. On the public chat hour at 128 GiB a move copies
about 394 MiB: 75 ms on one core of the 2-core machine the benchmarks ran on, 45 ms on two.
One thread copying a page at a time ran well below one memcpy of the same bytes in one
piece; the pages of one transfer are disjoint (each goes from a given-away segment to a slot
the giver keeps, and no two share either), so a few threads copy them at once, numpy letting
go of the GIL while it copies. Transfers are copied one after the other: a later one in the
same store may move again a page an earlier one moved.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Protocol

import numpy as np

# A few threads: enough to pull well past one core's copy speed, few enough to leave the
# engine's own threads their cores for the milliseconds a move takes.
THREADS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
# Below this, handing pages to threads costs about what it saves: one thread copies.
PARALLEL_BYTES = 16 * 1024 * 1024


class Rows(Protocol):
    array: np.ndarray       # one row per slot


class Relocator:
    """Copies one transfer's ``(region, from row, to row)`` moves, which must not share a row;
    ``copy`` returns once all are done. ``threads`` and ``parallel_bytes`` default to the
    module's ``THREADS`` and ``PARALLEL_BYTES``."""

    def __init__(self, threads: int | None = None, parallel_bytes: int | None = None):
        self.threads = THREADS if threads is None else threads
        self.parallel_bytes = PARALLEL_BYTES if parallel_bytes is None else parallel_bytes
        self._pool: ThreadPoolExecutor | None = None     # made at the first move that needs it
        self._pool_pid = 0                               # a forked child makes its own

    def copy(self, moves: Sequence[tuple[Rows, int, int]]) -> None:
        nbytes = sum(region.array[0].nbytes for region, _, _ in moves)
        if self.threads < 2 or nbytes < self.parallel_bytes or len(moves) < 2:
            for move in moves:
                _copy_one(move)
            return
        if self._pool is None or self._pool_pid != os.getpid():   # (a child has no threads)
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="hybridkv-relocate")
            self._pool_pid = os.getpid()
        futures = [self._pool.submit(_copy_one, move) for move in moves]
        wait(futures)                     # every copy ended before an error is raised
        for future in futures:
            future.result()

    def close(self) -> None:
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown()
        self._pool = None


def _copy_one(move: tuple[Rows, int, int]) -> None:
    region, src, dst = move
    region.array[dst] = region.array[src]
