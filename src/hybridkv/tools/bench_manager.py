"""Manager operations per second on the pools issue's trace (shared with vLLM's figures).

Keys are sha256(i as 8 LE bytes) + group 0 as 4 BE bytes; a pool of N slots is filled with
2N keys first so every slot is evictable; timed traces run in chunks of 1,024 operations.
"""

from __future__ import annotations

import gc
import hashlib
import random
import statistics
import time

from hybridkv.ram.grouped_pools import GroupedPools

CHUNK = 1024


def make_key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest() + (0).to_bytes(4, "big")


def _fresh_manager(n: int, policy: str) -> GroupedPools:
    mgr = GroupedPools({0: n}, policy)
    pool = mgr.pool(0)
    for start in range(0, 2 * n, CHUNK):
        keys = [make_key(i) for i in range(start, min(2 * n, start + CHUNK))]
        plan = pool.prepare_store(keys)
        pool.complete_store(plan.keys)
    return mgr


def _timed_runs(ops: list, body) -> float:
    gc.collect()
    t = time.perf_counter()
    for start in range(0, len(ops), CHUNK):
        body(ops[start:start + CHUNK])
    return len(ops) / (time.perf_counter() - t)


def measure(n: int = 1_000_000, policy: str = "lru", repeats: int = 5, seed: int = 0) -> dict:
    """Median ops/s over ``repeats`` for lookup, store cycle and touch (GC on)."""
    mgr = _fresh_manager(n, policy)
    pool = mgr.pool(0)
    rng = random.Random(seed)
    next_key = 2 * n
    results: dict[str, list[float]] = {"lookup": [], "store": [], "touch": []}
    for _ in range(repeats):
        resident = pool.resident_keys()
        sample = [bytes(bytearray(k)) for k in rng.choices(resident, k=n)]  # equal, not identical

        def lookups(chunk):
            lookup = pool.lookup
            for k in chunk:
                lookup(k)
        results["lookup"].append(_timed_runs(sample, lookups))

        def touches(chunk):
            touch = pool.touch
            for k in chunk:
                touch([k])
        results["touch"].append(_timed_runs(sample, touches))

        new = [make_key(i) for i in range(next_key, next_key + n // 4)]
        next_key += n // 4

        def cycles(chunk):
            prepare, complete = pool.prepare_store, pool.complete_store
            for k in chunk:
                prepare([k])
                complete([k])
        results["store"].append(_timed_runs(new, cycles))
    return {
        "lookup_ops_per_s": statistics.median(results["lookup"]),
        "store_cycles_per_s": statistics.median(results["store"]),
        "touch_ops_per_s": statistics.median(results["touch"]),
        "spread": {k: [min(v), max(v)] for k, v in results.items()},
    }
