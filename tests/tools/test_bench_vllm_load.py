"""The serving-load benchmark's workloads and report (its servers run in the benchmark itself:
two `vllm serve` starts are too slow for the test run)."""

import pytest

from hybridkv.tools.bench_vllm_load import (
    reuse_prompts,
    step_figures,
    steps_table,
    table,
    unique_prompts,
)


def test_unique_prompts_share_no_block_and_reuse_prompts_do():
    unique = unique_prompts(16)
    assert len({tuple(p[:64]) for p in unique}) == 16 and all(1024 <= len(p) <= 2048 for p in unique)
    reuse = reuse_prompts(32)
    system = [p for i, p in enumerate(reuse) if i % 2]
    assert len({tuple(p[:1536]) for p in system}) <= 3                  # behind 3 system prompts
    turns = [p for i, p in enumerate(reuse) if i % 2 == 0]
    first, again = turns[0], turns[8]                                  # user 0, turns 1 and 2
    assert again[:len(first)] == first and len(again) == len(first) + 256


def test_table_reports_both_servers_and_their_ratio():
    run = {"requests_per_s": 2.0, "output_tokens_per_s": 32.0, "ttft_p50_ms": 100.0, "ttft_p99_ms": 300.0,
           "itl_p50_ms": 10.0, "itl_p99_ms": 40.0, "hit_rate": 0.0}
    res = {"runs": {"unique": {"vllm": run, "hybridkv": {**run, "requests_per_s": 1.9, "hit_rate": 0.5}}}}
    text = table(res)
    assert "| unique | hybridkv / vllm | 0.95x |" in text and "50.0%" in text


def _engine_run(scheduler_hooks: dict, worker_hooks: dict, stored: int) -> dict:
    """One engine process's results as ``run_engine`` returns them: a warm-up batch of one
    prompt and a timed batch of three, with the connector's stats."""
    return {"requests": [{"batch": [{}], "step_s": [0.5]}, {"batch": [{}, {}, {}], "step_s": [0.25, 0.25]}],
            "stats": {"vllm": {"engine_s": sum(scheduler_hooks.values()), "hook_s": scheduler_hooks,
                               "worker_engine_s": sum(worker_hooks.values()), "worker_hook_s": worker_hooks},
                      "cache": {"tiers": {"ram": {"bytes_in": stored}}}}}


def test_step_figures_add_up_each_hook_over_runs_and_sides_and_the_table_splits_them():
    runs = [_engine_run({"get_num_new_matched_tokens": 0.01, "build_connector_meta": 0.004}, {"wait_for_save": 0.02}, 10**8),
            _engine_run({"get_num_new_matched_tokens": 0.03}, {"wait_for_save": 0.02, "start_load_kv": 0.002}, 10**8)]
    f = step_figures(runs)
    assert f["hook_s"]["scheduler"] == pytest.approx({"get_num_new_matched_tokens": 0.04, "build_connector_meta": 0.004})
    assert f["hook_s"]["worker"] == pytest.approx({"wait_for_save": 0.04, "start_load_kv": 0.002})
    assert f["prompts"] == 8 and f["every_step_s"] == pytest.approx(2.0) and f["stored_bytes"] == 2 * 10**8
    assert f["hooks_share"] == pytest.approx(0.086 / 2.0) and f["batch_s"] == pytest.approx(0.5)
    text = steps_table({"vllm": step_figures([{k: v for k, v in run.items() if k != "stats"} for run in runs]),
                        "hybridkv_ram": f})
    assert "| `get_num_new_matched_tokens` | scheduler | 5000 µs | 2.00% |" in text
    assert "| `wait_for_save` | worker | 5000 µs | 2.00% |" in text
    assert "moved 191 MiB into RAM slots at 5.0 GB/s" in text
