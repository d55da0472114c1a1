"""``hybridkv demo``: the whole story in about a minute on a laptop CPU.

Every step's output is compared with a cold run of the same prompt (checked, not assumed).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridkv.config import CacheConfig
from hybridkv.engine.engine import Engine

B = 64


@dataclass
class Step:
    name: str
    prompt: str
    hit_tokens: int
    source: str
    ttft_s: float
    speedup: float
    identical: bool
    junction: int | None


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 259, n).tolist()


def _source(loaded: dict) -> str:
    used = [tier for tier, n in loaded.items() if n]
    return "+".join(used) if used else "-"


def run_demo(model: str = "tiny-hybrid", store: str | None = None, prompt_tokens: int = 3000,
             plot: str | None = None, progress=print, remote: str | None = None) -> list[Step]:
    tmp = None
    if store is None:
        tmp = tempfile.TemporaryDirectory(prefix="hybridkv-demo-")
        store = tmp.name
    system = _tokens(prompt_tokens - 200, 1)
    prompts = {
        "A": system + _tokens(200, 2),
        "A'": system + _tokens(200, 3),
        "A''": system + _tokens(200, 4),
        "B": _tokens(prompt_tokens, 5),
        "C": _tokens(prompt_tokens, 6),
    }
    pages_per_prompt = prompt_tokens // B + 1
    probe = Engine(model, CacheConfig(block_tokens=B), use_cache=False)
    attention_bytes = probe.layout.group(0).page_bytes
    state_bytes = probe.layout.state_bytes
    # RAM for about two prompts: the third distinct prompt pushes the oldest out to disk.
    ram = int(2.3 * pages_per_prompt * attention_bytes + 8 * state_bytes)
    config = CacheConfig(block_tokens=B, store=store, ram_bytes=ram, reference_tokens=prompt_tokens,
                         remote=remote)

    plan = [("cold A", "A"), ("A again (RAM)", "A"), ("sibling A' (junction)", "A'"),
            ("sibling A'' (hits junction)", "A''"), ("new process: A (disk)", "A"),
            ("pressure: B", "B"), ("pressure: C", "C"), ("C again (RAM)", "C"),
            ("A again (disk after eviction)", "A")]
    total = len(plan) + len(prompts)
    progress(f"hybridkv demo: model {model}, {prompt_tokens}-token prompts, block {B}, "
             f"RAM {ram / 2**20:.1f} MiB, store {store}")
    probe.generate(_tokens(B // 2, 0), 2)           # warm-up: first calls pay one-time costs
    cold = {}
    for i, (label, ids) in enumerate(prompts.items(), 1):
        progress(f"[{i}/{total}] cold control for {label} ...")
        cold[label] = probe.generate(ids, 8)

    steps: list[Step] = []
    engine = Engine(model, config)
    engine.generate(_tokens(B // 2, 0), 2)          # warm-up; shorter than a block, stores nothing
    try:
        for j, (name, label) in enumerate(plan, len(prompts) + 1):
            progress(f"[{j}/{total}] {name} ...")
            if name.startswith("new process"):
                engine.cache.drain()
                row = _generate_in_new_process(model, config, prompts[label])
                hit, loaded, ttft, junction = (row["hit_tokens"], row["loaded_pages"], row["ttft_s"],
                                               row["junction"])
                identical = (row["output_token_ids"] == cold[label].output_token_ids
                             and row["logits_digest"] == cold[label].logits_digest)
            else:
                r = engine.generate(prompts[label], 8)
                hit, loaded, ttft, junction = r.hit_tokens, r.loaded_pages, r.ttft_s, r.junction
                identical = r.logits_digest == cold[label].logits_digest
            steps.append(Step(name, label, hit, _source(loaded), ttft, cold[label].ttft_s / ttft,
                              identical, junction))
    finally:
        engine.close()
        if tmp is not None:
            tmp.cleanup()
    if plot:
        _plot(steps, plot)
    return steps


def _generate_in_new_process(model: str, config: CacheConfig, ids: list[int]) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    cmd = [sys.executable, "-m", "hybridkv", "generate", "--model", model, "--prompt-ids", f.name,
           "--store", config.store, "--ram-bytes", str(config.ram_bytes), "--block-tokens",
           str(config.block_tokens), "--max-new-tokens", "8", "--json"]
    if config.remote:
        cmd += ["--remote", config.remote]
    env_config = {"HYBRIDKV_REFERENCE_TOKENS": str(config.reference_tokens)}
    import os

    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env_config})
    Path(f.name).unlink(missing_ok=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child process failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout.splitlines()[-1])


def format_table(steps: list[Step]) -> str:
    head = f"{'step':<32} {'hit tokens':>10} {'source':>7} {'TTFT ms':>9} {'speedup':>8}  identical to cold"
    lines = [head, "-" * len(head)]
    for s in steps:
        junction = f"  (junction stored at {s.junction})" if s.junction else ""
        speedup = f"{s.speedup:>7.1f}x" if s.hit_tokens else f"{'-':>8}"
        lines.append(f"{s.name:<32} {s.hit_tokens:>10} {s.source:>7} {s.ttft_s * 1000:>9.1f} "
                     f"{speedup}  {'yes' if s.identical else 'NO'}{junction}")
    return "\n".join(lines)


def _plot(steps: list[Step], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("hybridkv: matplotlib is not installed; no chart (pip install 'hybridkv[plot]')",
              file=sys.stderr)
        return
    colours = {"-": "#999999", "ram": "#2a9d8f", "fs": "#e9c46a", "remote": "#e76f51"}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.bar(range(len(steps)), [s.ttft_s * 1000 for s in steps],
           color=[colours.get(s.source.split("+")[-1], "#264653") for s in steps])
    ax.set_xticks(range(len(steps)), [s.name for s in steps], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("hybridkv demo: TTFT per step (grey = computed, green = RAM, yellow = disk)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_demo(args) -> int:
    started = time.perf_counter()
    progress = (lambda _msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    steps = run_demo(args.model, args.store, args.prompt_tokens, args.plot, progress, args.remote)
    if args.json:
        print(json.dumps([vars(s) for s in steps]))
    else:
        print(format_table(steps))
        if args.plot:
            print(f"chart written to {args.plot}")
        print(f"done in {time.perf_counter() - started:.0f} s")
    return 0 if all(s.identical for s in steps) else 1
