"""The worker half: attaches the scheduler's RAM regions by path and copies pages.

Loads are asynchronous in vLLM's sense: they run in a step in which the request is not
scheduled, and the request runs once ``get_transfer_results`` reported it, so vLLM's own Mamba
bookkeeping (which copies the state of the hit's block forward before each step) sees the
loaded state. Stores run after the forward (the blocks hold what it just wrote). Nothing here
decides what to copy. A failed copy is reported, never raised into vLLM: a failed load fails
its request's transfer (vLLM recomputes the request or fails it, by its
``kv_load_failure_policy``) and a failed store is abandoned.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

from hybridkv.integrations.vllm.layout import layout_from_vllm
from hybridkv.integrations.vllm.messages import Copy, StepPlan, WorkerReport
from hybridkv.integrations.vllm.paged import PagedCopier
from hybridkv.ram.regions import SharedRegion

log = logging.getLogger(__name__)


def _merge(copies: list[Copy]) -> dict[int, tuple[list[int], list[int]]]:
    """One batch per group: a single gather/scatter per layer tensor."""
    merged: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for c in copies:
        merged[c.group][0].extend(c.slots)
        merged[c.group][1].extend(c.blocks)
    return merged


class WorkerSide:
    def __init__(self, vllm_config, kv_cache_config):
        self.layout = layout_from_vllm(vllm_config, kv_cache_config)
        self.num_blocks = kv_cache_config.num_blocks
        self.copier: PagedCopier | None = None
        self.regions: dict[int, SharedRegion] = {}
        self.report = WorkerReport()
        self.counters = {"load_bytes": 0, "store_bytes": 0, "load_s": 0.0, "store_s": 0.0}

    def register(self, kv_caches: dict) -> None:
        self.copier = PagedCopier(self.layout, kv_caches, self.num_blocks)
        for gid, parts in self.copier.parts.items():
            log.debug("hybridkv: group %d page = %s", gid,
                      [(tuple(p.tensor.shape), str(p.tensor.dtype), p.block_dim, p.nbytes) for p in parts])

    def _attach(self, plan: StepPlan) -> None:
        for gid, info in plan.regions.items():
            if gid not in self.regions:
                self.regions[gid] = SharedRegion.attach(info.path, info.slots, info.page_bytes)

    def load(self, plan: StepPlan) -> None:
        self.report.load_failures |= plan.failed_loads
        self.report.loaded |= plan.abandoned_loads      # nothing to copy: vLLM frees the blocks
        if not plan.loads:
            return
        requests = set(plan.loads)
        if self._copy("load", plan, plan.loads, self.copier.load):
            self.report.loaded |= requests
        else:               # vLLM recomputes these requests or fails them (its failure policy)
            self.report.load_failures |= requests

    def store(self, plan: StepPlan) -> None:
        if not plan.stores:
            return
        ok = self._copy("store", plan, plan.stores, self.copier.save)
        (self.report.stored if ok else self.report.store_failures).update(plan.stores)

    def _copy(self, kind: str, plan: StepPlan, batches: dict, copy) -> bool:
        t0 = time.perf_counter()
        try:
            self._attach(plan)          # a region that cannot be attached fails this copy only
            for gid, (slots, blocks) in _merge([c for cs in batches.values() for c in cs]).items():
                copy(gid, self.regions[gid], slots, blocks)
                self.counters[f"{kind}_bytes"] += len(slots) * self.regions[gid].page_bytes
            return True
        except Exception:
            log.exception("hybridkv: %s failed; those pages are recomputed or not cached", kind)
            return False
        finally:
            self.counters[f"{kind}_s"] += time.perf_counter() - t0

    def take_counters(self) -> dict:
        counters = self.counters
        self.counters = dict.fromkeys(counters, 0)
        return counters

    def take_report(self) -> WorkerReport | None:
        report, self.report = self.report, WorkerReport()
        return report or None

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """This step's loaded and failed requests; vLLM asks before it takes the step's report."""
        return set(self.report.loaded), set(self.report.load_failures)

    def close(self) -> None:
        for region in self.regions.values():
            region.close()
        self.regions = {}
