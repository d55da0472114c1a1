"""hybridkv's view of a vLLM engine: its layout and cache config from vLLM's own objects.

One hybridkv group per vLLM KV-cache group, with the original group id and the real bytes of
one block over the group's layers (padding excluded), times the tensor-parallel size: a page
holds every rank's slice, rank after rank, so the scheduler keeps one key and one slot per
block whatever the TP size and the tiers below RAM store pages as they always do.

The fingerprint carries the vLLM version and device (CPU-build attention pages hold K rows then
V rows per head, GPU pages K|V per token), the model and its weights' identity, the block size,
the TP size, and each group's tensors per rank (shapes and dtypes: the KV-cache dtype, the
state dtypes, the heads a rank holds), so a change of any of them misses instead of serving
bytes that mean something else.

Also the connector's own settings from ``kv_connector_extra_config`` (where disk and Redis
reads run, whether a RAM hit loads in the step that runs its request) and the vLLM versions
this release was tested with.
"""

from __future__ import annotations

import logging
import os
import re

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
)

from hybridkv.config import CacheConfig, load_config
from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import Group, GroupKind, Layout, TensorSpec
from hybridkv.identity import checkpoint_revision, software_versions

log = logging.getLogger(__name__)
COMMIT = re.compile(r"[0-9a-f]{40}")
# kv_connector_extra_config keys that belong to the integration, not to CacheConfig.
INTEGRATION_KEYS = ("stats_file", "async_promotion", "load_within_step")


def group_kind(spec, prefix_cacheable: bool) -> GroupKind:
    if not prefix_cacheable:
        return GroupKind.SCRATCH
    if isinstance(spec, MambaSpec):
        return GroupKind.STATE
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind.SLIDING_WINDOW
    if isinstance(spec, AttentionSpec):
        return GroupKind.ATTENTION
    return GroupKind.SCRATCH      # a cache type hybridkv does not know is recomputed, never guessed


def layout_from_vllm(vllm_config, kv_cache_config: KVCacheConfig, identify: bool = True) -> Layout:
    """Refuses, with the fix, any engine whose pages cannot line up with hybridkv's blocks.
    ``identify=False`` leaves out the weights' identity: the workers need only the page
    sizes, and hashing a local checkpoint's weights once (the scheduler) is enough."""
    block = vllm_config.cache_config.block_size
    tp = supported_tensor_parallel_size(vllm_config.parallel_config)
    cacheable = set(kv_cache_config.prefix_cacheable_group_ids)
    groups = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = group_kind(spec, gid in cacheable)
        if kind is not GroupKind.SCRATCH and spec.block_size != block:
            raise HybridKVError(
                f"vLLM KV-cache group {gid} ({type(spec).__name__}) has block_size "
                f"{spec.block_size} but the scheduler's is {block}; hybridkv stores states on "
                "the scheduler's block grid, so set --block-size to a value all groups accept")
        window = spec.sliding_window if kind is GroupKind.SLIDING_WINDOW else None
        page = tp * len(group.layer_names) * spec.real_page_size_bytes
        tensors = tensor_signature(spec, vllm_config.cache_config) if kind is not GroupKind.SCRATCH else ()
        groups.append(Group(gid, kind, page, window, tuple(group.layer_names), tensors))
    model = vllm_config.model_config
    return Layout(
        model=str(model.model), block_tokens=block, groups=tuple(groups),
        max_model_len=model.max_model_len, revision=model_revision(model) if identify else None, dtype=str(model.dtype),
        tp_rank=0, tp_size=tp, engine=f"{software_versions('vllm', 'torch')}, {device_type()} pages")


def supported_tensor_parallel_size(parallel) -> int:
    """TP ranks of one host share the scheduler's RAM regions; anything else is refused."""
    pp = getattr(parallel, "pipeline_parallel_size", 1)
    nodes = getattr(parallel, "nnodes", 1)
    if pp != 1 or nodes != 1:
        raise HybridKVError(
            f"HybridKVConnector supports tensor parallelism on one host (pipeline_parallel_size=1, "
            f"nnodes=1); this engine has pipeline_parallel_size={pp}, nnodes={nodes}: run one "
            "server per pipeline or node, or leave out --kv-transfer-config")
    return parallel.tensor_parallel_size


def tensor_signature(spec, cache_config) -> tuple[TensorSpec, ...]:
    """What one rank's block of a layer holds: [H, N, C] and the KV-cache dtype for attention
    (fp8_e4m3 and fp8_e5m2 pages have the same size), each state's shape and dtype for Mamba."""
    if isinstance(spec, MambaSpec):
        return tuple(TensorSpec(f"state{i}", tuple(shape), str(dtype))
                     for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes, strict=True)))
    width = spec.state_content_size_bytes // spec.dtype.itemsize
    cache_dtype = getattr(cache_config, "cache_dtype", "auto")
    return (TensorSpec(f"kv:{cache_dtype}", (spec.num_kv_heads, spec.block_size, width), str(spec.dtype)),)


def device_type() -> str:
    from vllm.platforms import current_platform

    return current_platform.device_type or "unknown"


def model_revision(model_config) -> str | None:
    """What the weights are: a local directory by its files' digest, a Hub model by the
    commit it resolved to (a branch name such as "main" moves, so it is not enough)."""
    if os.path.isdir(str(model_config.model)):
        return checkpoint_revision(model_config.model)
    for candidate in (getattr(model_config.hf_config, "_commit_hash", None), model_config.revision):
        if isinstance(candidate, str) and COMMIT.fullmatch(candidate):
            return candidate
    return None            # a branch or nothing: the weights are unknown (persistent tiers refuse)


def cache_config_from_extra(extra: dict, block_tokens: int) -> CacheConfig:
    """``kv_connector_extra_config`` (over ``HYBRIDKV_*`` variables) as a CacheConfig whose
    block size is vLLM's; a different ``block_tokens`` is refused rather than re-gridded."""
    settings = {k: v for k, v in extra.items() if k not in INTEGRATION_KEYS}
    given = settings.pop("block_tokens", None)
    if given is not None and int(given) != block_tokens:
        raise HybridKVError(
            f"kv_connector_extra_config block_tokens={given} differs from vLLM's block size "
            f"{block_tokens}; leave block_tokens out (it follows --block-size)")
    return load_config(overrides={**settings, "block_tokens": block_tokens,
                                  "engine_block_tokens": block_tokens})

TESTED_VLLM = ("0.32.0",)


def check_vllm_version() -> None:
    """One start-up line naming the vLLM versions this release was tested with; a warning on
    others (the connector touches a few of vLLM's internals: docs/vllm.md lists them)."""
    import vllm

    version = vllm.__version__.split("+")[0]
    if version in TESTED_VLLM:
        log.info("hybridkv: vLLM %s, a version this release was tested with", vllm.__version__)
    else:
        log.warning("hybridkv: vLLM %s is not one this release was tested with (%s); see the "
                    "internals it relies on in docs/vllm.md", vllm.__version__, ", ".join(TESTED_VLLM))


def async_promotion(extra: dict, vllm_config) -> bool:
    """Read disk/Redis pages in the background? ``async_promotion`` in the extra config (true,
    false, or "auto": only where vLLM recomputes a failed load, so a failed read costs a
    recompute, never the request)."""
    setting = extra.get("async_promotion", "auto")
    if setting == "auto":
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        return getattr(transfer, "kv_load_failure_policy", "fail") == "recompute"
    if not isinstance(setting, bool):
        raise HybridKVError(f"kv_connector_extra_config async_promotion={setting!r} is not valid; "
                            'use true, false or "auto"')
    return setting


def load_within_step(extra: dict, kv_cache_config) -> bool:
    """Copy a RAM hit in the step that runs its request (``load_within_step``, default true)?
    Never for a model whose groups replay a window after a hit: vLLM may then accept fewer
    tokens than the hit, and a synchronous load has no way to fail."""
    setting = extra.get("load_within_step", True)
    if not isinstance(setting, bool):
        raise HybridKVError(f"kv_connector_extra_config load_within_step={setting!r} is not valid; "
                            "use true or false")
    groups = getattr(kv_cache_config, "kv_cache_groups", ())
    return setting and not any(getattr(g.kv_cache_spec, "prefix_replay_tokens", 0) for g in groups)
