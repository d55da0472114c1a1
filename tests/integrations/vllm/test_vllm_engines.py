"""Stock vLLM with HybridKVConnector, one family at a time, in real engine processes.

Engine A serves a prompt cold, repeats it from RAM (vLLM's own prefix cache emptied first),
serves a sibling that shares a prefix (hybridkv stores the junction state), a third prompt
that hits at that junction, then four of them at once in one batch, twice: restored by
hybridkv, then by vLLM's own prefix cache. Last, P after a reset of both caches (as after a
weight update), and P once more. Engine B is a new process on the same store with a small
RAM budget: it restores the prompt from disk (from Redis for the Llama run, which gets a
store of its own), then other prompts push it out of RAM while a recent one still hits. For
two families engine B recomputes failed loads (``kv_load_failure_policy: recompute``), so its
disk reads run in the background; the others wait for them inside the lookup.
Every restore is compared with a cold run of the same tokens.
"""

import pytest

from engines import corrupt_stored_page, keys_of, run_engine, tokens

HYBRID = ["lfm2", "qwen3_next", "granite_h"]
FAMILIES = ["llama", *HYBRID]
BACKGROUND_READS = {"qwen3_next", "granite_h"}      # engine B promotes asynchronously
P, R = tokens(1, 2048), tokens(9, 2048)
SIBLING, THIRD = P[:1100] + tokens(2, 948), P[:1100] + tokens(3, 948)
PRESSURE = [tokens(10 + i, 2048) for i in range(3)]
BATCH = [P, R, SIBLING, THIRD]
_runs: dict[str, dict] = {}


def replay(n: int, B: int) -> int:
    return (n - 1) // B * B


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory, redis_server):
    """Runs A and B of a family once (the engines are the expensive part)."""
    def get(family: str) -> dict:
        if family not in _runs:
            work = tmp_path_factory.mktemp(family)
            model = checkpoints(family)
            store = work / "store"
            store.mkdir()
            remote = {"remote": redis_server.url, "remote_prefix": f"t-{family}"} if family == "llama" else {}
            a = run_engine(model, family, {"store": str(store), "ram_bytes": "64MiB", **remote}, [
                {"tokens": P}, {"tokens": P, "reset": True},
                {"tokens": SIBLING, "reset": True}, {"tokens": THIRD, "reset": True},
                {"tokens": THIRD, "reset": True, "salt": "cold"}, {"tokens": R, "reset": True},
                {"batch": BATCH, "reset": True}, {"batch": BATCH},
                {"tokens": P, "reset_connector": True}, {"tokens": P, "reset": True},
            ], work, "A")
            B = a["stats"]["block_tokens"]
            # A foreign byte in R's stored state at its replay boundary: B must miss it.
            if family in HYBRID:
                state_group = 0
                corrupt_stored_page(store, state_group, keys_of(R, B)[replay(len(R), B) // B - 1])
            b_store = work / "store-b" if family == "llama" else store
            b_store.mkdir(exist_ok=True)
            b = run_engine(model, family, {"store": str(b_store), "ram_bytes": "4MiB", **remote}, [
                {"tokens": P}, {"tokens": R, "reset": True},
                *({"tokens": q, "reset": True} for q in PRESSURE),
                {"tokens": PRESSURE[-1], "reset": True}, {"tokens": P, "reset": True},
            ], work, "B", transfer={"kv_load_failure_policy": "recompute"} if family in BACKGROUND_READS else None)
            _runs[family] = {"A": a, "B": b, "block_tokens": B}
        return _runs[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_repeat_restores_from_ram_with_identical_tokens(runs, family):
    r = runs(family)
    cold, warm = r["A"]["requests"][0], r["A"]["requests"][1]
    assert cold["cached"] == 0
    assert warm["cached"] >= replay(len(P), r["block_tokens"]) - r["block_tokens"]
    assert warm["tokens"] == cold["tokens"]
    assert r["A"]["stats"]["requests"][1]["sources"]["ram"] > 0
    if family == "lfm2":     # its pages tile 64 KiB segments: the worker restored through arena views
        assert r["A"]["stats"]["cache"]["arena"]["segments"] >= 64


@pytest.mark.parametrize("family", FAMILIES)
def test_new_process_restores_from_the_store(runs, family):
    r = runs(family)
    restored = r["B"]["requests"][0]
    assert restored["cached"] >= replay(len(P), r["block_tokens"]) - r["block_tokens"]
    assert restored["tokens"] == r["A"]["requests"][0]["tokens"]
    tier = "remote" if family == "llama" else "fs"
    assert r["B"]["stats"]["requests"][0]["sources"][tier] > 0
    assert r["B"]["stats"]["vllm"]["async_promotion"] == (family in BACKGROUND_READS)


@pytest.mark.parametrize("family", FAMILIES)
def test_third_request_hits_at_the_sibling_junction(runs, family):
    r = runs(family)
    B = r["block_tokens"]
    junction = 1100 // B * B
    sibling, third, cold_third = r["A"]["requests"][2:5]
    if family in HYBRID:
        assert sibling["cached"] == 0          # P's only state is at P's replay boundary
        assert r["A"]["stats"]["requests"][2]["stored"]["state"] > 0
    assert third["cached"] >= junction > 0
    assert cold_third["cached"] == 0
    assert third["tokens"] == cold_third["tokens"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_restored_by_hybridkv_decodes_as_vllms_own_prefix_cache_does(runs, family):
    """P, R, P's sibling and the third prompt submitted together, every page in RAM: the step
    that runs the batch loads them all before its forward (vLLM's synchronous load), and every
    pin is released. vLLM on CPU is not batch-invariant (plain vLLM decodes P in this batch
    differently from P alone), so the reference is the same batch again, now served from
    vLLM's own prefix cache: the same hits, the same shapes. (A prompt twice in one batch
    would not do: vLLM runs the second copy a step later when the first one's blocks are
    loaded in the step, so the two batches would not have the same shapes.)"""
    r = runs(family)
    restored, local = r["A"]["requests"][6]["batch"], r["A"]["requests"][7]["batch"]
    junction = 1100 // r["block_tokens"] * r["block_tokens"]
    assert [b["cached"] >= junction for b in restored] == [True] * 4, restored
    assert [b["cached"] for b in local] == [b["cached"] for b in restored]
    assert [b["tokens"] for b in restored] == [b["tokens"] for b in local]
    stats = r["A"]["stats"]
    last = {h["request"]: h for h in stats["requests"]}    # one asked twice is listed twice
    order = sorted(last, key=lambda rid: int(rid.split("-")[0]))    # the LLM numbers requests
    batches = order[6:14]                       # requests 6-9 and 10-13: the two batches
    assert [last[rid]["loaded_tokens"] > 0 for rid in batches] == [True] * 4 + [False] * 4, last
    assert stats["vllm"]["loads_within_step"] >= 5          # P alone, then the batch
    assert stats["vllm"]["load_failures"] == 0
    assert all(g["evictable"] == g["used"] for g in stats["cache"]["groups"].values())   # no pin left


@pytest.mark.parametrize("family", FAMILIES)
def test_connector_reset_serves_nothing_stored_before_then_stores_anew(runs, family):
    """vLLM's reset_prefix_cache(reset_connector=True), its cascade after a weight update."""
    r = runs(family)
    a = r["A"]["requests"]
    after_reset, again = a[8], a[9]
    assert after_reset["cached"] == 0 and after_reset["tokens"] == a[0]["tokens"]
    assert again["cached"] >= replay(len(P), r["block_tokens"]) - r["block_tokens"]
    assert again["tokens"] == a[0]["tokens"]


@pytest.mark.parametrize("family", HYBRID)
def test_corrupt_page_is_a_miss_not_wrong_tokens(runs, family):
    r = runs(family)
    restored = r["B"]["requests"][1]
    assert restored["cached"] < replay(len(R), r["block_tokens"])
    assert restored["tokens"] == r["A"]["requests"][5]["tokens"]
    assert r["B"]["stats"]["cache"]["tiers"]["fs"].get("corrupt", 0) >= 1
    stats = r["B"]["stats"]["vllm"]
    if family in BACKGROUND_READS:      # found in the background: the load fails, vLLM recomputes
        assert stats["promotion_failures"] == 1 and stats["load_failures"] == 1, stats
    else:                               # found inside the lookup: the hit shrinks
        assert stats["promotion_failures"] == 0 and stats["load_failures"] == 0, stats


@pytest.mark.parametrize("family", FAMILIES)
def test_ram_pressure_evicts_old_prefixes_and_keeps_the_recent_one(runs, family):
    r = runs(family)
    history = r["B"]["stats"]["requests"]
    recent, old = history[-2], history[-1]
    assert sum(g["evictions"] for g in r["B"]["stats"]["cache"]["groups"].values()) > 0
    assert recent["loaded_tokens"] > 0 and set(recent["sources"]) >= {"ram"}
    assert recent["sources"]["ram"] > 0 and not any(n for tier, n in recent["sources"].items() if tier != "ram")
    tier = "remote" if family == "llama" else "fs"
    assert old["loaded_tokens"] > 0 and old["sources"][tier] > 0
    assert r["B"]["requests"][-1]["tokens"] == r["A"]["requests"][0]["tokens"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_time_vllms_steps_spent_in_the_connector_is_counted_on_both_halves(runs, family):
    """What hybridkv adds to vLLM's engine loop (every hook's wall time), the scheduler's and
    the workers' as they reported it: more than nothing, less than the requests took."""
    a = runs(family)["A"]
    vllm_stats = a["stats"]["vllm"]
    took = sum(r["seconds"] for r in a["requests"])
    assert 0 < vllm_stats["engine_s"] < took
    assert 0 < vllm_stats["worker_engine_s"] < took
    # by hook: the lookup, the step's plan and the copies out are among them, and they add up
    assert {"get_num_new_matched_tokens", "build_connector_meta"} <= vllm_stats["hook_s"].keys()
    assert "wait_for_save" in vllm_stats["worker_hook_s"]
    assert sum(vllm_stats["hook_s"].values()) == pytest.approx(vllm_stats["engine_s"])
    assert sum(vllm_stats["worker_hook_s"].values()) == pytest.approx(vllm_stats["worker_engine_s"])
