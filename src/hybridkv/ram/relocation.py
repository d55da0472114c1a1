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
same store may move again a page an earlier one moved. One pool of threads serves every
cache in the process, as one thread maps every region ahead (``regions.POPULATOR``).
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

_pool: ThreadPoolExecutor | None = None       # made at the first move that needs it


class Rows(Protocol):
    array: np.ndarray       # one row per slot


def copy_moves(moves: Sequence[tuple[Rows, int, int]], parallel_bytes: float | None = None) -> None:
    """Copy one transfer's ``(region, from row, to row)`` moves, which must not share a row;
    returns once all are done. On ``THREADS`` threads from ``parallel_bytes`` (default
    ``PARALLEL_BYTES``) on, below it on the caller's."""
    global _pool
    threshold = PARALLEL_BYTES if parallel_bytes is None else parallel_bytes
    if THREADS < 2 or len(moves) < 2 or sum(region.array[0].nbytes for region, _, _ in moves) < threshold:
        for move in moves:
            _copy_one(move)
        return
    if _pool is None:
        _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="hybridkv-relocate")
    futures = [_pool.submit(_copy_one, move) for move in moves]
    wait(futures)                         # every copy ended before an error is raised
    for future in futures:
        future.result()


def _copy_one(move: tuple[Rows, int, int]) -> None:
    region, src, dst = move
    region.array[dst] = region.array[src]


def _forget_pool_after_fork() -> None:
    """A forked child has none of its parent's threads: it makes a pool of its own."""
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool_after_fork)
