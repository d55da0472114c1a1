"""The serving-load benchmark's workloads and report (its servers run in the benchmark itself:
two `vllm serve` starts are too slow for the test run)."""

from hybridkv.tools.bench_vllm_load import reuse_prompts, table, unique_prompts


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
