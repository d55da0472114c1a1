"""Manager operations per second on the pools issue's trace, for hybridkv's pool and, as its
peer in the same run, vLLM's own ``CPUOffloadingManager`` when vLLM can be run.

Keys are sha256(i as 8 LE bytes) + group 0 as 4 BE bytes; a pool of N slots is filled with
2N keys first so every slot is evictable; timed traces run in chunks of 1,024 operations.
vLLM lives in its own environment (``.venv-vllm``, see docs/vllm.md), so its side runs as
``python -m hybridkv.tools.bench_manager N POLICY REPEATS`` under that interpreter.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hybridkv.ram.pool import SlotPool, make_pool

CHUNK = 1024


def make_key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest() + (0).to_bytes(4, "big")


class _VLLMPool:
    """vLLM's CPUOffloadingManager behind the pool calls the trace makes. Each chunk of 1,024
    operations gets a fresh request context (vLLM tracks keys per request), and finished
    requests are not reported, which spares vLLM that cost: the comparison favours vLLM."""

    def __init__(self, n: int, policy: str):
        from vllm.v1.kv_offload.base import LookupResult
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self._mgr, self._hit = CPUOffloadingManager(n, policy), LookupResult.HIT
        self._requests = 0
        self.new_request()
        self._filled: list[bytes] = []

    def new_request(self):
        from vllm.v1.kv_offload.base import ReqContext

        self._requests += 1
        ctx = ReqContext(f"bench-{self._requests}")
        self._mgr.on_new_request(ctx)
        # partials, not methods: the trace calls vLLM with no Python frame of ours in between
        self.lookup = functools.partial(self._mgr.lookup, req_context=ctx)
        # vLLM 0.34 dropped touch(): measured where it exists, reported as missing elsewhere
        self.touch = functools.partial(self._mgr.touch, req_context=ctx) if hasattr(self._mgr, "touch") else None
        self.prepare_store = functools.partial(self._mgr.prepare_store, req_context=ctx)
        self.complete_store = functools.partial(self._mgr.complete_store, req_context=ctx)

    def fill(self, keys):
        self.new_request()
        out = self.prepare_store(keys)
        self.complete_store(out.keys_to_store)
        self._filled += keys

    def resident_keys(self):
        return [k for k in self._filled if self.lookup(k) is self._hit]


class _HybridKVPool:
    """The pool the cache uses (compiled when built), or with ``pure_python`` its fallback."""

    def __init__(self, n: int, policy: str, pure_python: bool = False):
        self._pool = SlotPool(0, n, policy) if pure_python else make_pool(0, n, policy)
        self.lookup, self.touch = self._pool.lookup, self._pool.touch
        self.prepare_store, self.complete_store = self._pool.prepare_store, self._pool.complete_store
        self.resident_keys = self._pool.resident_keys

    def new_request(self):
        pass

    def fill(self, keys):
        self.complete_store(self.prepare_store(keys).keys)


BACKENDS = ("hybridkv", "python", "vllm")


def _fresh_pool(n: int, policy: str, backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"unknown manager backend {backend!r}; use one of {BACKENDS}")
    pool = _VLLMPool(n, policy) if backend == "vllm" else _HybridKVPool(n, policy, backend == "python")
    for start in range(0, 2 * n, CHUNK):
        pool.fill([make_key(i) for i in range(start, min(2 * n, start + CHUNK))])
    return pool


def _timed_runs(ops: list, body, pool) -> float:
    gc.collect()
    t = time.perf_counter()
    for start in range(0, len(ops), CHUNK):
        pool.new_request()
        body(ops[start:start + CHUNK])
    return len(ops) / (time.perf_counter() - t)


def measure(n: int = 1_000_000, policy: str = "lru", repeats: int = 5, seed: int = 0,
            backend: str = "hybridkv") -> dict:
    """Median ops/s over ``repeats`` for lookup, store cycle and touch (GC on). ``backend``:
    hybridkv's pool as the cache builds it, its pure-Python fallback, or vLLM's manager."""
    pool = _fresh_pool(n, policy, backend)
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
        results["lookup"].append(_timed_runs(sample, lookups, pool))

        def touches(chunk):
            touch = pool.touch
            for k in chunk:
                touch([k])
        if pool.touch is not None:
            results["touch"].append(_timed_runs(sample, touches, pool))

        new = [make_key(i) for i in range(next_key, next_key + n // 4)]
        next_key += n // 4

        def cycles(chunk):
            prepare, complete = pool.prepare_store, pool.complete_store
            for k in chunk:
                prepare([k])
                complete([k])
        results["store"].append(_timed_runs(new, cycles, pool))
    return {
        "lookup_ops_per_s": statistics.median(results["lookup"]),
        "store_cycles_per_s": statistics.median(results["store"]),
        "touch_ops_per_s": statistics.median(results["touch"]) if results["touch"] else None,
        "spread": {k: [min(v), max(v)] for k, v in results.items() if v},
    }


def vllm_python() -> str | None:
    """An interpreter that can import vLLM: this one, $HYBRIDKV_VLLM_PYTHON or ./.venv-vllm."""
    import importlib.util

    if importlib.util.find_spec("vllm"):
        return sys.executable
    candidate = os.environ.get("HYBRIDKV_VLLM_PYTHON") or str(Path(".venv-vllm/bin/python").absolute())   # not resolve(): that leaves the venv
    return candidate if os.access(candidate, os.X_OK) else None


def measure_vllm(n: int, policy: str, repeats: int) -> dict | None:
    """vLLM's manager on the same trace, in its own environment; None when vLLM is not at hand."""
    python = vllm_python()
    if python is None:
        return None
    proc = subprocess.run([python, "-m", "hybridkv.tools.bench_manager", str(n), policy, str(repeats)],
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return {"python": python, **json.loads(proc.stdout.strip().splitlines()[-1])}


if __name__ == "__main__":
    slots, which, times = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    print(json.dumps(measure(slots, which, times, backend="vllm")))
