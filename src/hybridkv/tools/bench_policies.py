"""Which state policy reuses the most: every policy on every workload and trace at 3 budgets.

    python -m hybridkv.tools.bench_policies --traces DIR --out docs/bench_policies.json \\
        --plot docs/img/policies.png

Replays, on the Qwen3-Next-80B-A3B layout: the four synthetic token workloads, four generated
Mooncake-format traces (shared system prompts, multi-turn sessions, branching agent sessions,
and all three mixed over 12,000 requests), and every ``*.jsonl`` Mooncake trace in ``--traces``
(e.g. the public FAST'25 traces). Pools are planned for each trace's mean prompt length.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hybridkv.config import load_layout
from hybridkv.tools.bench_common import machine
from hybridkv.tools.policy_compare import compare, plot, table
from hybridkv.tools.simulator import reference_tokens, workload_prompts
from hybridkv.tools.traces import read_trace
from hybridkv.tools.workloads import TRACE_WORKLOADS, WORKLOADS

GiB = 1024**3
LAYOUT = Path(__file__).resolve().parents[1] / "data" / "qwen3-next-80b-a3b.json"
WORKLOAD_BUDGETS = (2 * GiB, 8 * GiB, 32 * GiB)
TRACE_BUDGETS = (32 * GiB, 128 * GiB, 512 * GiB)


QUICK_SIZES = {"mixed_12k": {"requests": 600}, "multi_turn": {"sessions": 60}, "system_prompts": {"requests": 300},
               "agent_branches": {"sessions": 20}}


def run(traces: Path | None = None, quick: bool = False, synthetic: bool = True) -> dict:
    layout = load_layout(LAYOUT)
    sources: list[tuple[str, object, tuple[int, ...]]] = []
    for name in WORKLOADS if synthetic else ():
        sources.append((name, lambda n=name: workload_prompts(n), WORKLOAD_BUDGETS))
    for name in TRACE_WORKLOADS if synthetic else ():
        sources.append((name, lambda n=name: workload_prompts(n, **(QUICK_SIZES[n] if quick else {})), TRACE_BUDGETS))
    for path in sorted(traces.glob("*.jsonl")) if traces else []:
        sources.append((path.name, lambda p=path: [r.tokens for r in read_trace(p)], TRACE_BUDGETS))
    out = {"machine": machine(), "layout": layout.model, "comparisons": []}
    for name, load, budgets in sources:
        print(f"[policies] {name}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        prompts = load()
        c = compare(layout, prompts, budgets, name, reference_tokens(prompts, layout.block_tokens),
                    progress=sys.stderr.isatty())
        out["comparisons"].append({**c.to_json(), "seconds": time.perf_counter() - started})
    return out


def report(results: dict) -> str:
    """The markdown section of ``docs/benchmarks.md``."""
    lines = []
    for j in results["comparisons"]:
        lines += [f"#### {j['workload']} ({j['requests']:,} requests, mean prompt "
                  f"{j['prompt_tokens'] // j['requests']:,} tokens; replayed in {j['seconds']:.0f} s)\n", table(j), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridkv.tools.bench_policies", description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, help="directory of Mooncake-format *.jsonl traces to replay too")
    parser.add_argument("--out", type=Path, default=Path("docs/bench_policies.json"))
    parser.add_argument("--plot", type=Path, help="PNG chart of every comparison")
    parser.add_argument("--quick", action="store_true", help="smaller generated traces")
    parser.add_argument("--traces-only", action="store_true", help="replay only the files in --traces")
    args = parser.parse_args(argv)
    if args.traces is not None and not args.traces.is_dir():
        print(f"bench_policies: error: --traces {args.traces} is not a directory", file=sys.stderr)
        return 2
    if args.traces_only and args.traces is None:
        print("bench_policies: error: --traces-only needs --traces DIR", file=sys.stderr)
        return 2
    results = run(args.traces, args.quick, synthetic=not args.traces_only)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(args.out)
    if args.plot:
        plot(results["comparisons"], args.plot)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
