"""What the two halves of the connector send each other every step (plain, picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

# hook time goes with the next report or counters; on its own once it reaches this much
# (steps that copy nothing, as decoding ones, would otherwise never send theirs)
ENGINE_S_ALONE = 0.01


@dataclass(frozen=True)
class RegionInfo:
    """Where the worker attaches a group's shared RAM region."""

    path: str
    slots: int
    page_bytes: int


@dataclass
class Copy:
    """One group's copies: ``slots[i]`` <-> vLLM block ``blocks[i]``."""

    group: int
    slots: list[int]
    blocks: list[int]


@dataclass
class StepPlan(KVConnectorMetadata):
    """Scheduler -> worker: the regions, this step's loads (per request) and stores (per
    reservation, after the forward). A load runs before the forward when its request runs in
    this step (``loads_within_step``, vLLM's synchronous load), else after it. Also loads that ended before reaching the worker,
    which only the worker can report to vLLM: failed (a disk or Redis read did not read back)
    and abandoned (the request finished while its reads were in flight; vLLM holds its blocks
    until the load is reported)."""

    regions: dict[int, RegionInfo]
    loads: dict[str, list[Copy]]
    stores: dict[int, list[Copy]]
    failed_loads: set[str] = field(default_factory=set)
    abandoned_loads: set[str] = field(default_factory=set)
    loads_within_step: set[str] = field(default_factory=set)   # their requests run this step


@dataclass
class RankReport:
    """One worker's loads and stores completed (or failed) since its last report."""

    loaded: set[str] = field(default_factory=set)
    load_failures: set[str] = field(default_factory=set)
    stored: set[int] = field(default_factory=set)
    store_failures: set[int] = field(default_factory=set)
    mapped: bool = False          # the worker has just mapped every RAM region
    engine_s: float = 0.0         # seconds in the connector's hooks since the last report
    hook_s: dict[str, float] = field(default_factory=dict)    # engine_s by hook

    def __bool__(self) -> bool:
        return bool(self.loaded or self.load_failures or self.stored or self.store_failures or self.mapped
                    or self.engine_s)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler, by TP rank. Ranks finish a copy in different steps (a GPU copy
    completes when its event does), so vLLM's per-step merge keeps every rank's report and
    the scheduler completes a load or store once each rank reported it."""

    ranks: dict[int, RankReport] = field(default_factory=dict)

    def aggregate(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport({**self.ranks, **other.ranks})

    def __bool__(self) -> bool:
        return any(self.ranks.values())
