"""TTFT through stock vLLM: cold vs hybridkv RAM vs hybridkv disk (new process), against the
ceilings measured in the same run: vLLM without a connector (cold) and vLLM's own prefix
cache (a repeat in the same engine), and vLLM's native OffloadingConnector where it runs.
The disk restore runs twice, with the reads inside vLLM's scheduler (its default failure
policy) and in the background (``kv_load_failure_policy: recompute``); for both, how long
the scheduler waited in hybridkv's lookup, which every running request waits for too.

    .venv-vllm/bin/python -m hybridkv.tools.bench_vllm [--families lfm2,qwen3_next] [--tp 1,2] [--out F]

Each family runs at each tensor-parallel size of ``--tp`` with the same prompts (on vLLM's CPU
build a TP=N engine gets one core per rank, so TP=2 rows on a 2-core machine compare the
connector's cost, not serving speed).

TTFT is the wall time of a one-token generate call (scheduling, prefill and the first
sample); every figure is the median of ``--reps`` distinct prompts. The two ratios against a
ceiling (a RAM hit against vLLM's own hit, a disk restore against a RAM hit) pair each
prompt's two requests back to back in one process and take the median of their ratios.
Prints a markdown table and writes the raw figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridkv.integrations.vllm.tiny_models import dtype_of, save_tiny_checkpoint
from hybridkv.tools.bench_common import machine
from hybridkv.tools.bench_report import vllm_table

LENGTHS = (2048, 4096, 8000)
MAX_MODEL_LEN = 8192          # the tiny models' max_position_embeddings


def _prompts(length: int, reps: int) -> list[list[int]]:
    import random

    return [[random.Random(length * 100 + i).randrange(3, 512) for _ in range(length)]
            for i in range(reps)]


def run_engine(work: Path, name: str, model: Path, family: str, connector, requests,
               transfer: dict | None = None, tp: int = 1, time_steps: bool = False) -> dict:
    """One engine process running ``requests`` (``vllm_run``'s job format); its results, with
    each request's lookup time and, under ``"stats"``, the connector's stats file."""
    if connector is not None:
        connector = {**connector, "stats_file": str(work / f"{name}-stats.json")}
    job = {"model": str(model), "dtype": dtype_of(family), "connector": connector,
           "requests": requests, "max_model_len": MAX_MODEL_LEN, "transfer": transfer or {},
           "tensor_parallel_size": tp, "time_steps": time_steps}
    path = work / f"{name}.json"
    path.write_text(json.dumps(job))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hybridkv.tools.vllm_run", str(path)],
                          capture_output=True, text=True, timeout=900)
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("HYBRIDKV_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"error": root_cause(proc.stderr)}
    out = json.loads(line.split(" ", 1)[1])
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if connector is not None:      # the lookup times, in the order the requests were served
        out["stats"] = json.loads(Path(connector["stats_file"]).read_text())
        for req, seen in zip(out["requests"], out["stats"]["requests"], strict=False):
            req["match_ms"] = seen["match_ms"]
    return out


def _medians(requests: list[dict], indices: list[int]) -> dict:
    chosen = [requests[i] for i in indices]
    medians = {"ttft_s": statistics.median(r["seconds"] for r in chosen),
               "cached": statistics.median(r["cached"] for r in chosen)}
    if all("match_ms" in r for r in chosen):
        medians["match_ms"] = statistics.median(r["match_ms"] for r in chosen)
    return medians


def _paired_ratio(requests: list[dict], pairs: list[tuple[int, int]]) -> float | None:
    """Median over prompts of one request's TTFT over its partner's: the two ran back to back
    in one process, so the drift of a busy machine cancels (a ratio of two medians taken in
    passes minutes apart moved up to 1.6x between runs of the same code)."""
    if not all(requests[b]["cached"] for _, b in pairs):
        return None
    return statistics.median(requests[a]["seconds"] / requests[b]["seconds"] for a, b in pairs)


def bench_family(family: str, work: Path, reps: int, tp: int = 1) -> dict:
    model = work / "models" / family
    if not model.exists():
        save_tiny_checkpoint(family, model)
    prompts = {n: _prompts(n, reps) for n in LENGTHS}
    flat = [p for n in LENGTHS for p in prompts[n]]
    one = {"max_tokens": 1}
    # told the mean prompt, as a configured server is: unset, the cache would re-plan RAM after
    # 32 requests, in the middle of the RAM-hit pairs (emptying it where RAM is split statically)
    connector = {"store": str(work / f"store-{family}-tp{tp}"), "ram_bytes": "1GiB",
                 "reference_tokens": sum(LENGTHS) // len(LENGTHS)}
    Path(connector["store"]).mkdir(parents=True, exist_ok=True)
    # A: cold (hybridkv stores), then for each prompt in turn: after emptying vLLM's cache, a
    # hybridkv RAM hit, and at once again: vLLM's own prefix cache hit, in the same process
    # (engine processes of one configuration differ by more than these figures here).
    a = run_engine(work, f"{family}-A", model, family, connector,
                   [{"tokens": p, **one} for p in flat]
                   + [r for p in flat for r in ({"tokens": p, "reset": True, **one}, {"tokens": p, **one})], tp=tp)
    # B: a new process on the same store: for each prompt, a restore from disk (the reads
    # inside the lookup), then after emptying vLLM's cache a RAM hit in the same process;
    # D: the disk restore with the reads in the background.
    b = run_engine(work, f"{family}-B", model, family, connector,
                   [r for p in flat for r in ({"tokens": p, **one}, {"tokens": p, "reset": True, **one})], tp=tp)
    d = run_engine(work, f"{family}-D", model, family, connector, [{"tokens": p, **one} for p in flat],
                   transfer={"kv_load_failure_policy": "recompute"}, tp=tp)
    # C: stock vLLM: cold, then the repeat from its own prefix cache (the best case).
    c = run_engine(work, f"{family}-C", model, family, None,
                   [{"tokens": p, **one} for p in flat] + [{"tokens": p, **one} for p in flat], tp=tp)
    rows, total = [], len(flat)
    for i, n in enumerate(LENGTHS):
        ks = range(i * reps, (i + 1) * reps)
        ram, own = [total + 2 * k for k in ks], [total + 2 * k + 1 for k in ks]
        disk, ram_b = [2 * k for k in ks], [2 * k + 1 for k in ks]
        row = {"tokens": n}
        for label, run, indices in (("vllm_cold", c, list(ks)), ("vllm_local", c, [total + k for k in ks]),
                                    ("hybridkv_cold", a, list(ks)), ("hybridkv_ram", a, ram),
                                    ("vllm_local_beside_ram", a, own),
                                    ("hybridkv_disk", b, disk), ("hybridkv_ram_beside_disk", b, ram_b),
                                    ("hybridkv_disk_async", d, list(ks))):
            row[label] = _medians(run["requests"], indices) if "requests" in run else None
        if "requests" in a:
            row["ram_over_own_paired"] = _paired_ratio(a["requests"], list(zip(ram, own, strict=True)))
        if "requests" in b:
            row["disk_over_ram_paired"] = _paired_ratio(b["requests"], list(zip(disk, ram_b, strict=True)))
        rows.append(row)
    return {"family": family if tp == 1 else f"{family} TP={tp}", "tp": tp, "rows": rows,
            "errors": {k: r["error"] for k, r in (("A", a), ("B", b), ("C", c), ("D", d)) if "error" in r}}


def offloading_probe(work: Path) -> str:
    """vLLM's own CPU offload on this build: the outcome, in one line."""
    from vllm.config import KVTransferConfig  # noqa: F401  (fail here if vLLM is missing)

    model = save_tiny_checkpoint("llama", work / "models" / "llama")
    script = (
        "from vllm import LLM; from vllm.config import KVTransferConfig\n"
        f"LLM(model={str(model)!r}, enforce_eager=True, skip_tokenizer_init=True, max_model_len=4096,"
        " kv_transfer_config=KVTransferConfig(kv_connector='OffloadingConnector', kv_role='kv_both',"
        " kv_connector_extra_config={'cpu_bytes_to_use': 1 << 30}))\nprint('OFFLOADING_STARTED')\n")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=env)
    if "OFFLOADING_STARTED" in proc.stdout:
        return "started"
    return root_cause(proc.stderr)


def root_cause(stderr: str) -> str:
    """The last error line of a failed engine that is not vLLM's generic wrapper."""
    generic = ("Engine core initialization failed", "errors.pydantic.dev")
    lines = [ln for ln in stderr.splitlines() if "Error: " in ln and not any(g in ln for g in generic)]
    return (lines[-1] if lines else stderr[-200:]).split("] ")[-1].strip()[-300:]


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridkv.tools.bench_vllm")
    ap.add_argument("--families", default="lfm2,qwen3_next")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tp", default="1", help="tensor-parallel sizes, comma-separated (default 1)")
    ap.add_argument("--out", default="docs/bench_vllm.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-vllm-") as tmp:
        work = Path(tmp)
        results = {"machine": {**machine(), "vllm": _vllm_version()}, "families": [], "reps": args.reps}
        for family in args.families.split(","):
            for tp in (int(x) for x in args.tp.split(",")):
                print(f"bench_vllm: {family} at TP={tp} (four engine processes)", file=sys.stderr, flush=True)
                results["families"].append(bench_family(family, work, args.reps, tp))
        print("bench_vllm: probing vLLM's OffloadingConnector", file=sys.stderr, flush=True)
        results["offloading"] = offloading_probe(work)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(vllm_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
