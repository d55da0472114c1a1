"""The worker half: attaches the scheduler's RAM regions by path and copies pages.

One instance per TP rank. Each copies its own slice of every page (its heads, its state
slice) at its rank's byte range, on the device of vLLM's tensors (``device/page_copy.py``).

Loads are asynchronous in vLLM's sense: they run in a step in which the request is not
scheduled, and the request runs once ``get_transfer_results`` reported it, so vLLM's own Mamba
bookkeeping (which copies the state of the hit's block forward before each step) sees the
loaded state. Stores run after the forward (the blocks hold what it just wrote). A GPU copy
is reported when its event completed: a load before the forward that reads it, a store before
the scheduler publishes its page. Nothing here decides what to copy. A failed copy is
reported, never raised into vLLM: a failed load fails its request's transfer (vLLM recomputes
the request or fails it, by its ``kv_load_failure_policy``) and a failed store is abandoned.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

from hybridkv.device.page_copy import PageCopier, Transfer
from hybridkv.integrations.vllm.layout import layout_from_vllm
from hybridkv.integrations.vllm.messages import Copy, RankReport, StepPlan, WorkerReport
from hybridkv.integrations.vllm.views import block_views, check_views, resolved_layout
from hybridkv.ram.regions import SharedRegion

log = logging.getLogger(__name__)


def _merge(copies: list[Copy]) -> dict[int, tuple[list[int], list[int]]]:
    """One batch per group: a single gather/scatter per layer tensor."""
    merged: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for c in copies:
        merged[c.group][0].extend(c.slots)
        merged[c.group][1].extend(c.blocks)
    return merged


def tensor_parallel_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class WorkerSide:
    def __init__(self, vllm_config, kv_cache_config, rank: int | None = None):
        self.layout = layout_from_vllm(vllm_config, kv_cache_config, identify=False)
        self.kv_layout = resolved_layout(vllm_config, kv_cache_config)      # refuses unknown ones now
        self.rank = tensor_parallel_rank() if rank is None and self.layout.tp_size > 1 else rank or 0
        self.num_blocks = kv_cache_config.num_blocks
        self.copier: PageCopier | None = None
        self.regions: dict[int, SharedRegion] = {}
        self.report = RankReport()
        self._loads: list[tuple[set[str], list[Transfer]]] = []     # copies in flight
        self._stores: list[tuple[set[int], list[Transfer]]] = []
        self.counters = {"load_bytes": 0, "store_bytes": 0, "load_s": 0.0, "store_s": 0.0}

    def register(self, kv_caches: dict) -> None:
        views = block_views(self.layout, kv_caches, self.num_blocks)
        check_views(self.layout, views)
        pages = {g.id: g.page_bytes for g in self.layout.cacheable_groups}
        self.copier = PageCopier(views, pages, rank=self.rank, ranks=self.layout.tp_size)
        log.info("hybridkv: worker rank %d/%d copies on %s, %s layout, %s B of each page",
                 self.rank, self.layout.tp_size, self.copier.device, self.kv_layout,
                 {gid: n for gid, n in self.copier.slice_bytes.items()})

    def _attach(self, plan: StepPlan) -> None:
        for gid, info in plan.regions.items():
            if gid not in self.regions:
                self.regions[gid] = SharedRegion.attach(info.path, info.slots, info.page_bytes,
                                                        self.copier.pin_hook, self.rank)

    def load(self, plan: StepPlan) -> None:
        self.report.load_failures |= plan.failed_loads
        self.report.loaded |= plan.abandoned_loads      # nothing to copy: vLLM frees the blocks
        if not plan.loads:
            return
        requests = set(plan.loads)
        transfers = self._copy("load", plan, plan.loads, self.copier.load)
        if transfers is None:      # vLLM recomputes these requests or fails them (its failure policy)
            self.report.load_failures |= requests
        else:
            self._loads.append((requests, transfers))

    def store(self, plan: StepPlan) -> None:
        if not plan.stores:
            return
        reservations = set(plan.stores)
        transfers = self._copy("store", plan, plan.stores, self.copier.save)
        if transfers is None:
            self.report.store_failures |= reservations
        else:
            self._stores.append((reservations, transfers))

    def _copy(self, kind: str, plan: StepPlan, batches: dict, copy) -> list[Transfer] | None:
        t0 = time.perf_counter()
        try:
            self._attach(plan)          # a region that cannot be attached fails this copy only
            transfers = []
            for gid, (slots, blocks) in _merge([c for cs in batches.values() for c in cs]).items():
                transfers.append(copy(gid, self.regions[gid], slots, blocks))
                self.counters[f"{kind}_bytes"] += len(slots) * self.copier.slice_bytes[gid]
            return transfers
        except Exception:
            log.exception("hybridkv: %s failed; those pages are recomputed or not cached", kind)
            return None
        finally:
            self.counters[f"{kind}_s"] += time.perf_counter() - t0

    @staticmethod
    def _collect(pending: list, into: set) -> None:
        """Copies whose transfers all completed go into the report."""
        for entry in [e for e in pending if all(t.done() for t in e[1])]:
            pending.remove(entry)
            into.update(entry[0])

    def take_counters(self) -> dict:
        counters = self.counters
        self.counters = dict.fromkeys(counters, 0)
        return counters

    def take_report(self) -> WorkerReport | None:
        """Loads go in only through ``finished_loads``: vLLM must hear of a load before the
        scheduler unpins its pages."""
        self._collect(self._stores, self.report.stored)
        report, self.report = self.report, RankReport()
        return WorkerReport({self.rank: report}) if report else None

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Loads completed so far and failed ones; vLLM asks before it takes the step's report."""
        self._collect(self._loads, self.report.loaded)
        return set(self.report.loaded), set(self.report.load_failures)

    def close(self) -> None:
        for _, transfers in self._loads + self._stores:
            for t in transfers:
                t.wait()
        for region in self.regions.values():
            region.close()
        self.regions = {}
