import json
import shutil

import pytest

from hybridkv.tools.bench_report import plot, tables, vllm_table
from hybridkv.tools.bench_tiers import (
    bench_arena_move,
    bench_fs,
    bench_fs_batch,
    bench_fs_startup,
    bench_fs_startup_packed,
    bench_ram,
    bench_remote,
)

from helpers.cli import assert_one_line_error, cli, run_cli


def test_tier_benchmarks_report_ratios(tmp_path):
    ram = bench_ram(page_bytes=1 << 20, pages=8, repeats=2)
    assert ram["copy_gbps"] > 0 and ram["ratio"] == ram["copy_gbps"] / ram["memcpy_gbps"]
    fs = bench_fs(str(tmp_path), page_bytes=1 << 20, pages=4, repeats=1)
    assert fs["buffered"]["read_ratio"] > 0 and fs["mode"] in ("buffered", "direct")
    move = bench_arena_move(page_bytes=2 << 20, pages=8, repeats=2)     # 16 MiB: threads copy it
    assert min(move["one_thread_ms"], move["threaded_ms"], move["memcpy_ms"]) > 0
    assert move["speedup"] == move["one_thread_ms"] / move["threaded_ms"] and move["threads"] >= 1


def test_filesystem_batch_and_startup_benchmarks_report_ratios():
    (row,) = bench_fs_batch(page_sizes=(32 * 1024,), total_bytes=1 << 20, repeats=1)
    assert row["pages"] == 32 and row["ratio"] == row["read_gbps"] / row["raw_read_gbps"] > 0
    st = bench_fs_startup(pages=500)
    assert st["indexed"] == 500 and st["open_s"] > 0 and st["scanned_s"] >= st["open_s"]
    assert st["index_bytes_per_page"] > 0 and st["scan_ratio"] == st["scanned_s"] / st["raw_walk_s"]
    packed = bench_fs_startup_packed(pages=1000, per_pack=64)
    assert packed["indexed"] == 1000 and packed["packs"] == 16
    assert packed["open_s"] <= packed["packed_served_s"] <= packed["scanned_s"]
    assert row["raw_read_file_per_page_gbps"] > 0


def test_remote_benchmark(redis_url):
    r = bench_remote(redis_url, page_bytes=64 * 1024, pages=16, repeats=2)
    assert r["set_gbps"] > 0 and r["get_gbps"] > 0 and r["naive_get_gbps"] > 0
    ceiling = r["redis_benchmark"]           # timed in each repeat, beside the tier's own timings
    if shutil.which("redis-benchmark"):      # (installed with redis-server where CI runs)
        assert ceiling["repeats"] == 2 and ceiling["get_gbps"] > 0
        lo, hi = ceiling["spread"]["get"]
        assert lo <= ceiling["get_gbps"] <= hi
        assert ceiling["ratios"]["get"] > 0 and ceiling["ratios"]["set"] > 0


@pytest.mark.long
def test_bench_cli_quick_json_and_report(tmp_path):
    # vLLM's side of the manager comparison is tested in tests/integrations/vllm; here it is absent
    (tmp_path / "shm").mkdir()
    proc = run_cli("bench", "--quick", "--json", "--manager-slots", "4096", "--plot", tmp_path,
                   "--ram-dir", tmp_path / "shm", env={"HYBRIDKV_VLLM_PYTHON": str(tmp_path / "no-python")})
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert "]: manager: lru on 4,096 slots" in proc.stderr     # progress reaches stderr under --json
    assert set(res["ram"]) >= {"copy_gbps", "memcpy_gbps", "ratio"}
    assert set(res["fs"]) >= {"write_gbps", "read_gbps", "raw_write_gbps", "raw_read_gbps",
                              "write_ratio", "read_ratio"}
    [manager] = res["manager"]
    assert manager["slots"] == 4096
    for policy in ("lru", "arc"):
        for figures in (manager[policy], manager["python"][policy]):   # compiled and fallback
            assert set(figures) >= {"lookup_ops_per_s", "store_cycles_per_s", "touch_ops_per_s"}
    assert [r["prompt_tokens"] for r in res["restore"]] == [1024, 4096]
    B = 64                                   # the bench's block: everything up to the replay block
    assert all(r["identical"] and r["hit_tokens"] == (r["prompt_tokens"] - 1) // B * B
               and r["ram_dir"] == str(tmp_path / "shm") for r in res["restore"])
    assert all(r["lookup_wait_inside_ms"] > 0 and r["lookup_wait_background_ms"] > 0 and r["lookup_alone_ms"] > 0
               and r["lookup_beside_reads_ms"] > 0 for r in res["restore"])
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["throughput_vs_ceiling.png", "ttft_vs_prompt.png"]
    text = tables(res)
    assert "Restore vs recompute" in text and "| hybridkv lru |" in text
    assert "| prompt tokens | pages | reads inside the lookup ms | reads in the background ms |" in text
    assert "batched reads as a promotion does them" in text and "page files" in text
    assert f"An arena move's copy ({res['arena_move']['pages']} idle pages of 6 MiB" in text
    assert "vllm" not in manager and "| vLLM | not measured in this run" in text
    assert "| hybridkv arc, pure-Python fallback |" in text
    assert plot(res, tmp_path / "again")


def test_bench_cli_misuse():
    assert_one_line_error(cli("bench", "--manager-slots", "10"), "--manager-slots must be at least 1024")
    assert_one_line_error(cli("bench", "--ram-dir", "/nonexistent/shm"), "--ram-dir /nonexistent/shm is not a directory")


def test_vllm_table_names_the_machine_when_the_run_recorded_it():
    def ttft(seconds, cached):
        return {"ttft_s": seconds, "cached": cached}

    row = {"tokens": 2048, "vllm_cold": ttft(0.2, 0), "vllm_local": ttft(0.02, 1920),
           "hybridkv_cold": ttft(0.2, 0), "hybridkv_ram": ttft(0.025, 1920), "hybridkv_disk": ttft(0.05, 1920)}
    results = {"families": [{"family": "lfm2", "rows": [row]}], "reps": 1, "offloading": "refused"}
    assert vllm_table(results).startswith("| family |")        # older runs: no machine recorded
    results["machine"] = {"cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0+cpu", "vllm": "0.32.0"}
    text = vllm_table(results)
    assert text.startswith("Machine: AMD EPYC, 2 cores; vLLM 0.32.0, torch 2.13.0+cpu.")
    assert "| lfm2 | 2,048 | 200 ms (0 cached) |" in text and "| 8.0x / 4.0x | 1.25x | 2.00x |" in text
    row["hybridkv_disk_async"] = {**ttft(0.04, 1920), "match_ms": 0.5}
    row["hybridkv_disk"]["match_ms"], row["hybridkv_ram"]["match_ms"] = 20.0, 0.5
    text = vllm_table(results)          # what the disk adds to the RAM hit, and the lookup's part
    assert "| 50 ms | 20.0 ms | 40 ms | 0.5 ms | 0.03x | 25.0 ms | 19.5 ms |" in text
    # newer runs: the ratios compare figures of one process (vLLM's own hit beside hybridkv's
    # RAM hits, the RAM hit beside the disk restore)
    row["vllm_local_beside_ram"] = ttft(0.0125, 1920)
    row["hybridkv_ram_beside_disk"] = {**ttft(0.04, 1920), "match_ms": 1.0}
    text = vllm_table(results)
    assert "| 8.0x / 4.0x | 2.00x | 1.25x |" in text and "| 10.0 ms | 19.0 ms |" in text
    # newest: each prompt's two requests ran back to back, the median of their ratios is shown
    row["ram_over_own_paired"], row["disk_over_ram_paired"] = 1.1, 1.3
    assert "| 8.0x / 4.0x | 1.10x | 1.30x |" in vllm_table(results)


def test_the_lookup_benchmark_times_lookups_during_and_after_a_scan_against_ram_only(tmp_path):
    from hybridkv.tools.bench_lookup import main

    out = tmp_path / "lookup.json"
    assert main(["--pages", "3000", "--files", "300", "--tokens", "1024", "--requests", "5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["pages"] == 3000 and result["ready_s"] > 0
    for key in ("after_scan", "ram_only"):
        assert result[key]["lookups"] == 5 and 0 < result[key]["p50_ms"] <= result[key]["max_ms"]
    assert result["background_stats"] > 0             # the misses were looked for off the thread


def test_bench_policies_on_a_trace_directory(tmp_path):
    """Every comparison of the policy benchmark has the JSON shape the page renders, no wrong
    hit, and the given trace directory's files among its traces."""
    from hybridkv.tools import bench_policies
    from hybridkv.tools.traces import write_mooncake
    from hybridkv.tools.workloads import multi_turn_trace

    traces = tmp_path / "traces"
    traces.mkdir()
    lines = list(multi_turn_trace(sessions=20, turns=3))
    write_mooncake(traces / "mine.jsonl", lines, 512)
    out = tmp_path / "p.json"
    assert bench_policies.main(["--traces", str(traces), "--traces-only", "--out", str(out),
                                "--plot", str(tmp_path / "p.png")]) == 0
    results = json.loads(out.read_text())
    assert [c["workload"] for c in results["comparisons"]] == ["mine.jsonl"]
    assert all(p["wrong_hits"] == 0 for c in results["comparisons"] for p in c["policies"].values())
    assert "semantic-tail" in bench_policies.report(results) and (tmp_path / "p.png").stat().st_size > 1000
    assert bench_policies.main(["--traces", str(tmp_path / "absent")]) == 2
    assert bench_policies.main(["--traces-only"]) == 2
