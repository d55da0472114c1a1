"""``hybridkv bench``: every figure next to the ceiling measured in the same run.

Parts: tier copy speeds (``bench_tiers``), manager operations per second (``bench_manager``),
restore vs recompute TTFT on the default model (``bench_restore``). State policies on workloads
and traces are ``bench_policies``, lookups during a store's scan ``bench_lookup``, figures
through vLLM ``bench_vllm``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hybridkv.tools import bench_manager, bench_tiers
from hybridkv.tools.bench_common import MiB, machine
from hybridkv.tools.bench_restore import bench_hashing, bench_hit_lookup, bench_restore

MANAGER_SLOTS = {False: (10_000, 200_000, 1_000_000), True: (10_000, 100_000)}


def bench_manager_size(slots: int, repeats: int, progress: Callable[[str], None]) -> dict:
    """hybridkv's pool, its pure-Python fallback and (when at hand) vLLM's manager at one size."""
    out: dict = {"slots": slots}
    for policy in ("lru", "arc"):
        progress(f"manager: {policy} on {slots:,} slots, compiled and pure Python")
        out[policy] = bench_manager.measure(slots, policy, repeats)
        out.setdefault("python", {})[policy] = bench_manager.measure(slots, policy, repeats, backend="python")
        progress(f"manager: vLLM's CPUOffloadingManager, {policy} on {slots:,} slots (if vLLM is at hand)")
        peer = bench_manager.measure_vllm(slots, policy, repeats)
        if peer is not None:
            out.setdefault("vllm", {})[policy] = peer
    return out

def run_bench(quick: bool = False, remote: str | None = None, manager_slots: int | None = None,
              progress: Callable[[str], None] = lambda _m: None, ram_dir: str | None = None) -> dict:
    started = time.perf_counter()
    out: dict = {"mode": "quick" if quick else "full", "machine": machine()}
    progress("tiers: RAM slots vs memcpy")
    out["ram"] = bench_tiers.bench_ram(pages=32 if quick else 128)
    progress("tiers: an arena move's copy on one thread and on several vs memcpy")
    out["arena_move"] = bench_tiers.bench_arena_move(pages=16 if quick else 66, repeats=3 if quick else 5)
    progress("tiers: filesystem vs raw disk")
    out["fs"] = bench_tiers.bench_fs(pages=32 if quick else 128, repeats=3 if quick else 5)
    progress("tiers: filesystem batched reads (promotion path) vs raw reads of the same files")
    out["fs_batch"] = bench_tiers.bench_fs_batch(total_bytes=(16 if quick else 64) * MiB, repeats=3 if quick else 9)
    progress("tiers: opening a large filesystem store")
    out["fs_startup"] = bench_tiers.bench_fs_startup(20_000 if quick else 200_000)
    progress("tiers: opening a store of small pages in packs")
    out["fs_startup_packed"] = bench_tiers.bench_fs_startup_packed(100_000 if quick else 1_000_000)
    if remote:
        progress("tiers: remote")
        out["remote"] = [bench_tiers.bench_remote(remote, 64 * 1024, 2048, repeats=3 if quick else 5),
                         bench_tiers.bench_remote(remote, MiB, 256, repeats=3 if quick else 5)]
    progress("block-key hashing")
    out["hashing"] = bench_hashing()
    progress("hit lookup with a filesystem tier attached vs RAM only")
    out["hit_lookup"] = bench_hit_lookup(repeats=10 if quick else 20)
    out["manager"] = [bench_manager_size(n, 3 if quick else 5, progress)
                      for n in ([manager_slots] if manager_slots else MANAGER_SLOTS[quick])]
    progress("restore vs recompute")
    out["restore"] = bench_restore([1024, 4096] if quick else [1024, 4096, 16384, 32000], repeats=2 if quick else 3,
                                   ram_dir=ram_dir)
    out["seconds"] = time.perf_counter() - started
    return out
