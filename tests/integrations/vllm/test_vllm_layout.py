"""The layout hybridkv derives from vLLM's own objects, and what it refuses at start-up."""

import dataclasses

import pytest
import vllm

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import GroupKind
from hybridkv.integrations.vllm.layout import cache_config_from_extra, layout_from_vllm

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


def test_refuses_tensor_parallel_and_misaligned_state_blocks():
    with pytest.raises(HybridKVError, match="tensor_parallel_size=1"):
        layout_from_vllm(*vllm_objects(tp=2))
    with pytest.raises(HybridKVError, match="block_size 256 but the scheduler's is 128"):
        layout_from_vllm(*vllm_objects(state_block=256))


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
