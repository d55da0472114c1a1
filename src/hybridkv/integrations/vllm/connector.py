"""``HybridKVConnector``: hybridkv as a KV connector of stock vLLM (v1 connector API).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "HybridKVConnector",
      "kv_connector_module_path": "hybridkv.integrations.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"store": "/var/cache/hybridkv", "ram_bytes": "8GiB"}}'

vLLM builds one instance per role; this class only dispatches to the scheduler half
(``scheduler.py``) or the worker half (``worker.py``). The pages of a reported hit are pinned
in RAM, or being read into RAM from disk or Redis, when the hit is reported; a load is a
memory copy the worker makes once they are all there. A hit whose pages are all in RAM is
loaded synchronously in vLLM's sense: copied in the step that computes the rest of the
prompt, before its forward. One still being read from disk or Redis is asynchronous: copied
in a step of its own once the reads landed, so they never stall the engine
(``async_promotion``).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.integrations.vllm.scheduler import SchedulerSide
from hybridkv.integrations.vllm.worker import WorkerSide

# hybridkv's tiers as vLLM's metrics name them (vllm:prompt_tokens_cached_by_source); Redis is
# what vLLM calls a remote store, which it counts as external_unspecified
TIER_SOURCES = {"ram": CacheHitSource.HOST, "fs": CacheHitSource.DISK}


class HybridKVStats(KVConnectorStats):
    """Worker copy counters and the time both halves spent in vLLM's steps, summed over
    workers and shown in vLLM's metrics log."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out = {k: v for k, v in d.items() if k.endswith(("_tokens", "_pages"))}
        out["hybridkv_engine_ms"] = round(d.get("engine_s", 0.0) * 1e3, 3)
        out |= {"hybridkv_load_MB": round(d.get("load_bytes", 0) / 1e6, 3),
               "hybridkv_store_MB": round(d.get("store_bytes", 0) / 1e6, 3)}
        for kind in ("load", "store"):
            secs = d.get(f"{kind}_s", 0.0)
            if secs > 0:
                out[f"hybridkv_{kind}_GBps"] = round(d.get(f"{kind}_bytes", 0) / secs / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _log_like_vllm() -> None:
    """hybridkv's lines go where vLLM's go, in its format and at its level (else its INFO
    lines vanish: only vLLM's own logger has a handler), unless the operator configured the
    ``hybridkv`` logger."""
    ours, theirs = logging.getLogger("hybridkv"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def in_engine_loop(hook):
    """Counts the hook's wall time on its side (``engine_s``, and by hook): what hybridkv adds
    to vLLM's steps (the engine's loop waits for every hook), in the stats file and vLLM's
    metrics log."""
    name = hook.__name__

    @functools.wraps(hook)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            side = self.scheduler if self.scheduler is not None else self.worker
            side.count_hook(name, time.perf_counter() - start)
    return timed


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(vllm_config, kv_cache_config, extra)
        else:
            self.worker = WorkerSide(vllm_config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False          # a cache: a dropped store is only a later miss

    # -- scheduler --------------------------------------------------------------------------
    @in_engine_loop
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        tokens = self.scheduler.match(request, num_computed_tokens)
        return tokens, tokens > 0 and not self.scheduler.loads_within_step(request.request_id)

    @in_engine_loop
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.scheduler.allocated(request, blocks.get_block_ids(), num_external_tokens)

    @in_engine_loop
    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        sources: dict[CacheHitSource, int] = {}
        for tier, tokens in self.scheduler.hit_sources(request.request_id).items():
            if tokens:
                source = TIER_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
                sources[source] = sources.get(source, 0) + tokens
        if sum(sources.values()) != num_external_tokens:      # not this connector's load
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return sources

    @in_engine_loop
    def build_connector_meta(self, scheduler_output):
        scheduled = {}
        for new in scheduler_output.scheduled_new_reqs:
            scheduled[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for rid, start in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            scheduled[rid] = start
        counts = scheduler_output.num_scheduled_tokens
        spans = {rid: (start, start + counts.get(rid, 0)) for rid, start in scheduled.items()}
        block_state = scheduler_output.kv_connector_block_state
        return self.scheduler.plan_step(spans, block_state.get_block_ids, block_state.boundary_state_offloads)

    @in_engine_loop
    def has_pending_push_work(self) -> bool:
        return self.scheduler.pending_stores()

    def reset_cache(self) -> bool:
        return self.scheduler.reset()

    @in_engine_loop
    def update_connector_output(self, connector_output):
        self.scheduler.on_report(connector_output.kv_connector_worker_meta)

    @in_engine_loop
    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.finish(request.request_id)
        return False, None

    request_finished_all_groups = request_finished     # (vLLM's name for hybrid models)

    # -- worker -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        self.worker.register(kv_caches)

    @in_engine_loop
    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.worker.load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    @in_engine_loop
    def wait_for_save(self):
        self.worker.store(self._get_connector_metadata())

    @in_engine_loop
    def get_transfer_results(self, finished_req_ids) -> KVConnectorTransferResults:
        # Failed loads go by request: vLLM 0.32 refuses block-level failures
        # (get_block_ids_with_load_errors) for models with several KV cache groups, as hybrid
        # models have, and raises in its scheduler.
        loaded, failed = self.worker.finished_loads()
        return KVConnectorTransferResults(finished_recving=loaded | failed, failed_recving=failed)

    @in_engine_loop
    def build_connector_worker_meta(self):
        return self.worker.take_report()

    def get_kv_connector_stats(self):
        side = self.scheduler if self.scheduler is not None else self.worker
        counters = side.take_counters()
        return HybridKVStats(data=counters) if any(counters.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return HybridKVStats(data=dict(data or {}))

    def shutdown(self):
        if self.scheduler is not None:
            self.scheduler.close()
        if self.worker is not None:
            self.worker.close()
