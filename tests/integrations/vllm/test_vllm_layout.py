"""The layout hybridkv derives from vLLM's own objects, and what it refuses at start-up."""

import dataclasses

import pytest
import torch
import vllm

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import GroupKind
from hybridkv.integrations.vllm.layout import cache_config_from_extra, layout_from_vllm
from hybridkv.tools.gpu_check import LAYOUT_ORDERS, attention_caches

from engines import vllm_objects


def test_groups_keep_vllm_ids_and_real_unpadded_bytes():
    layout = layout_from_vllm(*vllm_objects())
    state, attention = layout.groups
    assert (state.id, state.kind, state.page_bytes) == (0, GroupKind.STATE, 2 * 3 * 128 * 4)
    assert (attention.id, attention.kind, attention.page_bytes) == (1, GroupKind.ATTENTION, 2 * 128 * 2 * 32 * 4)
    assert layout.block_tokens == 128 and f"vllm {vllm.__version__}, torch " in layout.engine


def test_fingerprint_follows_model_block_size_and_vllm_version():
    base = layout_from_vllm(*vllm_objects())
    assert layout_from_vllm(*vllm_objects(model="other")).fingerprint() != base.fingerprint()
    assert layout_from_vllm(*vllm_objects(block=256)).fingerprint() != base.fingerprint()
    assert dataclasses.replace(base, engine="vllm 0.0.1").fingerprint() != base.fingerprint()


def test_tensor_parallel_pages_hold_every_ranks_slice_and_name_the_tp_size():
    one, two = layout_from_vllm(*vllm_objects()), layout_from_vllm(*vllm_objects(tp=2))
    assert two.tp_size == 2 and [g.page_bytes for g in two.groups] == [2 * g.page_bytes for g in one.groups]
    assert two.fingerprint() != one.fingerprint()       # a TP=1 store is a miss at TP=2, and back
    state, attention = two.groups
    assert [(t.name, t.shape, t.dtype) for t in attention.tensors] == [("kv:auto", (2, 128, 64), "torch.float32")]
    assert [(t.name, t.shape) for t in state.tensors] == [("state0", (3, 128))]


def test_kv_cache_dtype_and_page_format_enter_the_fingerprint():
    """fp8_e4m3 and fp8_e5m2 pages have the same bytes; CPU-build and GPU pages the same size."""
    config, kv = vllm_objects()
    config.cache_config.cache_dtype = "fp8_e4m3"
    e4m3 = layout_from_vllm(config, kv)
    config.cache_config.cache_dtype = "fp8_e5m2"
    assert layout_from_vllm(config, kv).fingerprint() != e4m3.fingerprint()
    assert e4m3.engine.endswith(", cpu pages")


def test_refuses_pipeline_parallel_multi_node_and_misaligned_state_blocks():
    config, kv = vllm_objects()
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(HybridKVError, match="tensor parallelism on one host .* pipeline_parallel_size=2"):
        layout_from_vllm(config, kv)
    config.parallel_config.pipeline_parallel_size, config.parallel_config.nnodes = 1, 2
    with pytest.raises(HybridKVError, match="nnodes=2: run one server per pipeline or node"):
        layout_from_vllm(config, kv)
    with pytest.raises(HybridKVError, match="block_size 256 but the scheduler's is 128"):
        layout_from_vllm(*vllm_objects(state_block=256))


def test_an_unknown_kv_cache_layout_is_refused_at_start_up():
    from hybridkv.integrations.vllm.worker import WorkerSide

    config, kv = vllm_objects()
    kv.kv_cache_layout = "LBXNC"
    with pytest.raises(HybridKVError, match="layout 'LBXNC' is not one hybridkv knows .*set VLLM_KV_CACHE_LAYOUT"):
        WorkerSide(config, kv)
    kv.kv_cache_layout = "NHD"                           # vLLM's alias of LBNHC
    assert WorkerSide(config, kv).kv_layout == "LBNHC"


def test_extra_config_follows_vllm_block_size_and_refuses_another():
    config = cache_config_from_extra({"ram_bytes": "8MiB", "retention": 0, "stats_file": "x"}, 128)
    assert (config.block_tokens, config.ram_bytes) == (128, 8 * 1024**2)
    with pytest.raises(HybridKVError, match="block_tokens=64 differs"):
        cache_config_from_extra({"block_tokens": 64}, 128)
    with pytest.raises(HybridKVError, match="not a multiple"):
        cache_config_from_extra({"retention": 100}, 128)


def test_revision_is_the_weights_identity_not_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name, weights in (("a", b"1" * 64), ("b", b"2" * 64)):
        (tmp_path / name / "ckpt").mkdir(parents=True)
        (tmp_path / name / "ckpt" / "config.json").write_text("{}")
        (tmp_path / name / "ckpt" / "model.safetensors").write_bytes(weights)
    a = layout_from_vllm(*vllm_objects(model=tmp_path / "a" / "ckpt"))
    b = layout_from_vllm(*vllm_objects(model=tmp_path / "b" / "ckpt"))
    assert a.revision.startswith("sha256:") and a.revision != b.revision
    hub = layout_from_vllm(*vllm_objects(model="org/model", commit="c" * 40))
    assert hub.revision == "c" * 40          # the commit "main" resolved to, not "main"
    branch = layout_from_vllm(*vllm_objects(model="org/model", commit=None))
    assert branch.revision is None           # "main" (or nothing) does not name the weights
    # each TP worker needs page sizes only: it does not hash the weights again
    from hybridkv.integrations.vllm.worker import WorkerSide

    assert WorkerSide(*vllm_objects(model=tmp_path / "a" / "ckpt")).layout.revision is None


# vLLM splits blocks into kernel blocks only where a block is one dense page (LB** layouts)
CASES = [(name, 1) for name in LAYOUT_ORDERS] + [("LBHNC", 2), ("LBNHC", 2)]


@pytest.mark.parametrize(("name", "split"), CASES)
def test_the_copier_tests_build_caches_strided_as_vllm_does(name, split):
    """The copier's layout tests and the device check use ``attention_caches``, which must
    give each layout and kernel split the views vLLM's own ``create_kv_cache_views`` gives."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout, blocks, layers = KVCacheLayout[name], 6, 2
    spec = FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=2, dtype=torch.float32)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, blocks, layers, layout)
    size = layers * blocks * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=["a", "b"], layer_stride=layer_stride,
                           block_stride=block_stride, offset=0)
    theirs = create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, blocks, layout, tensor,
                                   kernel_block_size=8 // split)
    ours = attention_caches(name, layers=layers, blocks=blocks, heads=2, tokens=8, width=4,
                            dtype=torch.float32, split=split)
    for t, o in zip(theirs, ours, strict=True):
        assert (t.shape, t.stride(), t.storage_offset(), t.dtype) == (o.shape, o.stride(), o.storage_offset(), o.dtype)
