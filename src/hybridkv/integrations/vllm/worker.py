"""The worker half: attaches the scheduler's RAM regions by path and copies pages.

One instance per TP rank. Each copies its own slice of every page (its heads, its state
slice) at its rank's byte range, on the device of vLLM's tensors (``device/page_copy.py``).

A load whose request runs in this step (synchronous in vLLM's sense) is copied before the
forward, which waits for it on a GPU; it is reported to the scheduler only (vLLM expects no
word of it). Any other load is asynchronous: copied in a step in which its request does not
run, and reported through ``get_transfer_results`` once its transfer completed, after which
vLLM schedules the request. Stores run after the forward (the blocks hold what it just
wrote) and are reported once their transfers completed, before the scheduler publishes a page.
Nothing here decides what to copy. A failed asynchronous load fails its request's transfer
(vLLM recomputes the request or fails it, by its ``kv_load_failure_policy``) and a failed
store is abandoned; neither raises into vLLM. The scheduler plans a synchronous load only when
its copy cannot fail (pinned pages, regions mapped); if one does, this raises, as the forward
would otherwise read blocks that were never filled.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import partial

from hybridkv.core.errors import HybridKVError
from hybridkv.device.page_copy import PageCopier, Transfer
from hybridkv.integrations.vllm.layout import layout_from_vllm
from hybridkv.integrations.vllm.messages import (
    ENGINE_S_ALONE,
    Copy,
    RankReport,
    StepPlan,
    WorkerReport,
)
from hybridkv.integrations.vllm.views import block_views, check_views, resolved_layout
from hybridkv.ram.regions import PinningFailed, SharedRegion

log = logging.getLogger(__name__)


def _merge(copies: list[Copy]) -> dict[int, tuple[list[int], list[int]]]:
    """One batch per group: a single gather/scatter per layer tensor."""
    merged: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for c in copies:
        merged[c.group][0].extend(c.slots)
        merged[c.group][1].extend(c.blocks)
    return merged


@dataclass
class _Batch:
    """One step's loads (request ids) or stores (reservation ids) and their transfers."""

    kind: str
    ids: set
    transfers: list[Transfer] = field(default_factory=list)
    nbytes: int = 0


def tensor_parallel_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class WorkerSide:
    def __init__(self, vllm_config, kv_cache_config, rank: int | None = None):
        self.layout = layout_from_vllm(vllm_config, kv_cache_config, identify=False)
        self.kv_layout = resolved_layout(vllm_config, kv_cache_config)      # refuses unknown ones now
        if rank is None:
            rank = tensor_parallel_rank() if self.layout.tp_size > 1 else 0
        self.rank = rank
        self.num_blocks = kv_cache_config.num_blocks
        self.copier: PageCopier | None = None
        self.regions: dict[int, SharedRegion] = {}
        self.report = RankReport()
        self._loads: list[_Batch] = []       # copies in flight
        self._loads_within_step: list[_Batch] = []
        self._stores: list[_Batch] = []
        self.counters = {"load_bytes": 0, "store_bytes": 0, "load_s": 0.0, "store_s": 0.0}
        self.engine_s = 0.0                  # in the connector's hooks, all told
        self._engine_s_taken = {"counters": 0.0, "report": 0.0}
        self._hook_s: Counter = Counter()    # by hook, since the last report

    def count_hook(self, name: str, seconds: float) -> None:
        self.engine_s += seconds
        self._hook_s[name] += seconds

    def register(self, kv_caches: dict) -> None:
        views = block_views(self.layout, kv_caches, self.num_blocks)
        check_views(self.layout, views)
        pages = {g.id: g.page_bytes for g in self.layout.cacheable_groups}
        self.copier = PageCopier(views, pages, rank=self.rank, ranks=self.layout.tp_size)
        log.info("hybridkv: worker rank %d/%d copies on %s, %s layout, %s B of each page",
                 self.rank, self.layout.tp_size, self.copier.device, self.kv_layout,
                 {gid: n for gid, n in self.copier.slice_bytes.items()})

    def _attach(self, plan: StepPlan) -> None:
        """Map the regions the first time a plan names them, and the new ones after the cache
        re-planned RAM (the old ones unmapped once their copies are done). On a GPU this
        registers them with CUDA; a registration that fails for good (``PinningFailed``) stops
        the engine with one line: copies from pageable memory would run at a fraction of the
        speed, silently."""
        missing = [gid for gid, info in plan.regions.items()
                   if gid not in self.regions or str(self.regions[gid].path) != info.path]
        if any(gid in self.regions for gid in missing):     # the cache re-planned RAM: new regions
            self.copier.synchronize()
        for gid in missing:
            if gid in self.regions:
                self.copier.forget(gid)
                self.regions.pop(gid).close()
        mapped: dict[str, SharedRegion] = {}     # an arena: mapped (and pinned) once, a view per group
        for gid in missing:
            info = plan.regions[gid]
            if info.path in mapped:
                self.regions[gid] = mapped[info.path].view(info.page_bytes)
            else:
                base = SharedRegion.attach(info.path, info.slots, info.page_bytes, self.copier.pin_hook, self.rank)
                self.regions[gid] = mapped[info.path] = base
        if missing:
            self.report.mapped = True       # the scheduler may now plan loads within a step

    def load(self, plan: StepPlan) -> None:
        self.report.load_failures |= plan.failed_loads
        self.report.loaded |= plan.abandoned_loads      # nothing to copy: vLLM frees the blocks
        now = {rid: c for rid, c in plan.loads.items() if rid in plan.loads_within_step}
        later = {rid: c for rid, c in plan.loads.items() if rid not in plan.loads_within_step}
        if now:
            batch = self._copy("load", plan, now, partial(self.copier.load, feeds_forward=True), set(now))
            if batch is None:
                raise HybridKVError(f"hybridkv: the loads of requests {sorted(now)} failed in the step "
                                    "that runs them; their tokens would be computed from unfilled blocks. "
                                    "Set load_within_step: false in kv_connector_extra_config to load in a "
                                    "step of their own, and report this")
            self._loads_within_step.append(batch)
        if later:
            batch = self._copy("load", plan, later, self.copier.load, set(later))
            if batch is None:      # vLLM recomputes these requests or fails them (its failure policy)
                self.report.load_failures |= set(later)
            else:
                self._loads.append(batch)

    def store(self, plan: StepPlan) -> None:
        if not plan.stores:
            return
        reservations = set(plan.stores)
        batch = self._copy("store", plan, plan.stores, self.copier.save, reservations)
        if batch is None:
            self.report.store_failures |= reservations
        else:
            self._stores.append(batch)

    def _copy(self, kind: str, plan: StepPlan, batches: dict, copy, ids: set) -> _Batch | None:
        batch = _Batch(kind, ids)
        try:
            self._attach(plan)          # a region that cannot be attached fails this copy only
            for gid, (slots, blocks) in _merge([c for cs in batches.values() for c in cs]).items():
                region = self.regions[gid]
                batch.transfers.append(copy(gid, region, slots, blocks))
                region.map_ahead(max(slots, default=-1) + 1)   # the next steps' slots, before they copy
                batch.nbytes += len(slots) * self.copier.slice_bytes[gid]
            return batch
        except PinningFailed:
            raise                       # fatal (see _attach)
        except Exception:
            # parts of the batch may be queued already: none may land after it is reported
            self.copier.synchronize()
            log.exception("hybridkv: %s failed; those pages are recomputed or not cached", kind)
            return None

    def _collect(self, pending: list[_Batch], into: set) -> None:
        """Batches whose transfers all completed go into the report and the counters."""
        for batch in [b for b in pending if all(t.done() for t in b.transfers)]:
            pending.remove(batch)
            into.update(batch.ids)
            self.counters[f"{batch.kind}_bytes"] += batch.nbytes
            self.counters[f"{batch.kind}_s"] += sum(t.seconds() for t in batch.transfers)

    def _engine_s_since(self, taker: str) -> float:
        seconds = self.engine_s - self._engine_s_taken[taker]
        self._engine_s_taken[taker] = self.engine_s
        return seconds

    def _engine_s_due(self, taker: str) -> bool:
        return self.engine_s - self._engine_s_taken[taker] >= ENGINE_S_ALONE

    def take_counters(self) -> dict:
        """The copy counters since the last call, with the hook time that went with them (the
        time of steps that copied nothing waits until it reaches ``ENGINE_S_ALONE``)."""
        counters = self.counters
        if not any(counters.values()) and not self._engine_s_due("counters"):
            return counters
        self.counters = dict.fromkeys(counters, 0)
        return {**counters, "engine_s": self._engine_s_since("counters")}

    def take_report(self) -> WorkerReport | None:
        """Asynchronous loads go in only through ``finished_loads``: vLLM must hear of one
        before the scheduler unpins its pages. Synchronous ones go in here, after vLLM asked
        for this step's finished loads: it must never hear of them."""
        self._collect(self._stores, self.report.stored)
        self._collect(self._loads_within_step, self.report.loaded)     # after vLLM's finished_loads
        report, self.report = self.report, RankReport()
        if not report and not self._engine_s_due("report"):
            return None
        report.engine_s = self._engine_s_since("report")
        report.hook_s, self._hook_s = dict(self._hook_s), Counter()    # a plain dict crosses processes
        return WorkerReport({self.rank: report})

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Loads completed so far and failed ones; vLLM asks before it takes the step's report."""
        self._collect(self._loads, self.report.loaded)
        return set(self.report.loaded), set(self.report.load_failures)

    def close(self) -> None:
        for batch in self._loads + self._loads_within_step + self._stores:
            for t in batch.transfers:
                t.wait()
        for gid, region in self.regions.items():
            self.copier.forget(gid)
            region.close()
        self.regions = {}
