"""The device check's dry run on CPU, as a user runs it: one JSON summary, every round trip
bit-identical, bandwidth figures with their ceilings; bad flags exit 2 with one line."""

import json
import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "hybridkv.tools.gpu_check", *args],
                          capture_output=True, text=True, timeout=300)


def test_cpu_dry_run_passes_every_round_trip_and_reports_ceilings():
    proc = run("--device", "cpu", "--pages", "8", "--repeats", "1", "--engine-tokens", "256")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["ok"] and summary["device"] == "cpu"
    assert len(summary["round_trips"]) == 11 and all(summary["round_trips"].values())
    for row in summary["bandwidth"]:
        assert row["pages"] == 8 and row["save_GBps"] > 0 and row["ceiling_d2h_GBps"] > 0
    (restore,) = summary["engine"]
    assert restore["prompt_tokens"] == 256 and restore["hit_tokens"] == 192
    assert restore["identical"] and restore["loaded_from_disk"] and restore["cold_ttft_ms"] > 0


def test_bad_flags_exit_2_with_one_line():
    for args, fix in ((("--device", "cuda:7"), "use --device cpu"), (("--pages", "0"), "at least 1"),
                      (("--engine-tokens", "4k"), "comma-separated list of integers")):
        proc = run(*args)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and "error:" in last and fix in last, proc.stderr


def test_the_benchmarks_page_shows_a_gpu_run_or_says_there_was_none():
    from hybridkv.tools.bench_report import gpu_section

    assert "Not run yet" in gpu_section(None)
    summary = json.loads(run("--device", "cpu", "--pages", "4", "--repeats", "1", "--engine-tokens", "0").stdout)
    page = gpu_section(summary)
    assert "Round trips bit-identical: 11 of 11" in page and "| LBNHC | 1024 KiB |" in page
