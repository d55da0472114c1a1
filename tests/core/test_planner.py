import pytest

from hybridkv.config import load_layout
from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import layout_from_dict
from hybridkv.core.planner import plan_pools, unset_reference_warning

from helpers import LAYOUTS
from helpers.cli import assert_one_line_error, cli

GiB = 1024**3


@pytest.mark.parametrize("retention, reference, tokens, states", [
    (None, None, 107, 107), (6272, None, 280, 48), (0, None, 390, 10), (0, 16384, 326, 32),
])
def test_seed_table(retention, reference, tokens, states):
    plan = plan_pools(load_layout(LAYOUTS / "seed-flash-next.json"), 4 * GiB, retention, reference)
    assert plan.token_slots == tokens
    assert [g.slots for g in plan.groups] == [tokens, 0, states, states, states, states]
    assert plan.bytes_used <= 4 * GiB


def test_sparse_never_fewer_token_slots_than_dense_and_monotone_in_budget():
    for path in LAYOUTS.glob("*.json"):
        layout = load_layout(path)
        previous = 0
        for gib in (1, 2, 4, 8, 16, 64):
            dense = plan_pools(layout, gib * GiB, None, 32768)
            sparse = plan_pools(layout, gib * GiB, 0, 32768)
            assert sparse.token_slots >= dense.token_slots
            assert sparse.token_slots >= previous
            previous = sparse.token_slots
            assert all(g.slots == dense.token_slots for g in dense.groups if g.kind == "state")


def test_offload_block_larger_than_engine_block_refused_under_sparse():
    layout = load_layout(LAYOUTS / "seed-flash-next.json")
    with pytest.raises(HybridKVError, match="larger than the engine block"):
        plan_pools(layout, 4 * GiB, 0, engine_block_tokens=392)
    assert plan_pools(layout, 4 * GiB, None, engine_block_tokens=392).token_slots == 107


def test_cache_start_up_refuses_the_same_sparse_mismatch(tmp_path):
    """Not only 'plan': a cache configured this way never starts (the planner's sizes are the cache's)."""
    from hybridkv.cache import TieredCache
    from hybridkv.config import CacheConfig, load_config

    layout = load_layout(LAYOUTS / "seed-flash-next.json")
    config = load_config(overrides={"ram_bytes": "1GiB", "ram_dir": str(tmp_path), "retention": 0},
                         environ={"HYBRIDKV_ENGINE_BLOCK_TOKENS": "392"})
    with pytest.raises(HybridKVError, match="larger than the engine block 392"):
        TieredCache(layout, config)
    assert not list(tmp_path.iterdir())                # nothing was created
    dense = CacheConfig(ram_bytes="1GiB", ram_dir=str(tmp_path), retention="dense", engine_block_tokens=392)
    with TieredCache(layout, dense) as cache:
        assert cache.plan.token_slots > 0


def test_default_retention_follows_the_layouts_block_not_the_configs(tmp_path):
    """A config left at its defaults (64-token blocks) on a 784-token layout: 'auto' is a state
    every ~16K tokens of the layout's blocks, never a multiple of 64 the layout cannot keep."""
    from hybridkv.cache import TieredCache
    from hybridkv.config import CacheConfig

    with TieredCache(load_layout(LAYOUTS / "seed-flash-next.json"),
                     CacheConfig(ram_bytes="1GiB", ram_dir=str(tmp_path))) as cache:
        assert cache.plan.retention == 21 * 784


@pytest.mark.parametrize("kwargs, fragment", [
    ({"budget_bytes": 1000}, "cannot hold one slot per cacheable group"),
    ({"reference_tokens": 100}, "shorter than one block"),
    ({"retention": 1000}, "not a multiple"),
])
def test_validation(kwargs, fragment):
    layout = load_layout(LAYOUTS / "seed-flash-next.json")
    args = {"budget_bytes": 4 * GiB, "retention": 0, "reference_tokens": None} | kwargs
    with pytest.raises(HybridKVError, match=fragment):
        plan_pools(layout, **args)


def test_no_cacheable_group():
    layout = layout_from_dict({"model": "m", "block_tokens": 64,
                               "groups": [{"id": 0, "kind": "scratch", "page_bytes": 4}]})
    with pytest.raises(HybridKVError, match="no cacheable group"):
        plan_pools(layout, GiB, 0, 4096)


def test_cli_plan_json():
    import json
    proc = cli("plan", "--layout", LAYOUTS / "seed-flash-next.json", "--budget", "4GiB", "--retention", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_slots"] == 390 and out["retention"] == 0 and out["reference_tokens"] == 65536
    assert [g["slots"] for g in out["groups"]] == [390, 0, 10, 10, 10, 10]
    assert out["contexts"] == pytest.approx(390 * 784 / 65536)
    proc = cli("plan", "--layout", LAYOUTS / "seed-flash-next.json", "--budget", "4GiB",
                   "--retention", "dense", "--json")
    assert json.loads(proc.stdout)["retention"] is None
    # by default a state every ~16K tokens too: three more per 65,536-token prompt, fewer KV slots
    default = json.loads(cli("plan", "--layout", LAYOUTS / "seed-flash-next.json", "--budget", "4GiB", "--json").stdout)
    assert default["retention"] == 21 * 784 and default["token_slots"] < out["token_slots"]   # 784-token blocks


def test_cli_plan_table():
    proc = cli("plan", "--layout", LAYOUTS / "granite-4.0-h-small.json", "--budget", "8GiB")
    assert proc.returncode == 0
    assert "token slots" in proc.stdout and "state" in proc.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--budget", "4GiB", "--retention", "100"], "not a multiple"),
    (["--budget", "10"], "cannot hold one slot"),
    (["--budget", "4GiB", "--reference-tokens", "10"], "shorter than one block"),
    (["--budget", "4GiB", "--engine-block-tokens", "392"], "larger than the engine block"),
    (["--budget", "four"], "--budget: cannot read"),
])
def test_cli_plan_errors(args, fragment):
    proc = cli("plan", "--layout", LAYOUTS / "seed-flash-next.json", *args)
    assert_one_line_error(proc, fragment)


def test_cli_bad_layout_file(tmp_path):
    bad = tmp_path / "l.json"
    bad.write_text('{"model": "m", "block_tokens": 64, "groups": [{"id": 0, "kind": "mamba", "page_bytes": 1}]}')
    assert_one_line_error(cli("plan", "--layout", bad, "--budget", "1GiB"), "groups[0].kind")
    assert_one_line_error(cli("plan", "--budget", "1GiB"), "--layout")


def test_a_server_not_told_the_prompt_length_is_warned_only_where_states_are_cached():
    """Split statically for the model's longest prompts, RAM holds states for a few requests
    where prompts are short until it re-plans: a server says so once at start, with the
    setting to give. One budget shared by the groups follows the traffic: nothing to say."""
    hybrid = load_layout(LAYOUTS / "seed-flash-next.json")
    warning = unset_reference_warning(hybrid, None, False)
    assert f"for {hybrid.max_model_len}-token prompts" in warning and "Set it to your mean" in warning
    assert unset_reference_warning(hybrid, 8192, False) is None
    assert unset_reference_warning(hybrid, None, True) is None
    attention_only = layout_from_dict({"model": "kv", "block_tokens": 16, "max_model_len": 4096,
                                       "groups": [{"id": 0, "kind": "attention", "page_bytes": 4096}]})
    assert unset_reference_warning(attention_only, None, False) is None
