"""How long an engine's scheduler waits in a lookup on a store's tier: a lookup runs on the
scheduler thread, so every running request waits for it too.

    python -m hybridkv.tools.bench_lookup [--pages 1000000] [--files 200000] [--tokens 32768]
                                          [--requests 200] [--out F]

A store of ``--pages`` packed pages and ``--files`` page files. An engine's cache waits once,
at start-up, for the pack tables (``ready_s``); then, each the p50 / p99 / max of
``Connector.begin`` over cold prompts (every key a miss, the costliest lookup: nothing in RAM,
every key asked of the disk tier):
- while the rest of the start-up scan (the page files) runs;
- over ``--requests`` cold prompts once the store is scanned.
The ceiling is the same lookups with no disk tier at all (RAM only), in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hybridkv.config import CacheConfig
from hybridkv.core.layout import layout_from_dict
from hybridkv.tools.bench_tiers import make_file_store, make_packed_store

B = 64
PACE_S = 0.005


def _layout():
    return layout_from_dict({"model": "bench-lookup", "block_tokens": B, "max_model_len": 1 << 20,
                             "groups": [{"id": 0, "kind": "attention", "page_bytes": 32 * 1024},
                                        {"id": 1, "kind": "state", "page_bytes": 65536}]})


def _figures(ms: list[float]) -> dict | None:
    if not ms:
        return None
    ordered = sorted(ms)
    return {"lookups": len(ms), "p50_ms": statistics.median(ms),
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "max_ms": ordered[-1]}


def _lookups(conn, tokens: int, until) -> list[float]:
    """``Connector.begin`` on fresh random prompts, one every ``PACE_S`` (a busy server's
    arrival rate), until ``until(times so far)``; their times in ms."""
    rng, ms = np.random.default_rng(tokens), []
    while not until(ms):
        ids = rng.integers(0, 150_000, tokens).tolist()
        t = time.perf_counter()
        req = conn.begin(f"r{len(ms)}", ids)
        ms.append((time.perf_counter() - t) * 1e3)
        conn.finish(req)
        time.sleep(PACE_S)
    return ms


def measure(pages: int = 1_000_000, files: int = 200_000, tokens: int = 32768, requests: int = 200) -> dict:
    from hybridkv.cache import TieredCache
    from hybridkv.connector import Connector
    from hybridkv.tiers.filesystem import FilesystemTier

    layout = _layout()
    config = CacheConfig(block_tokens=B, ram_bytes=64 << 20, reference_tokens=tokens)
    root = Path(tempfile.mkdtemp(prefix="hybridkv-bench-lookup-"))
    try:
        make_packed_store(root, layout, pages)
        make_file_store(root, layout, files, first=pages)
        with TieredCache(layout, config, secondaries=[]) as cache:
            ram_only = _lookups(Connector(cache), tokens, lambda ms: len(ms) >= requests)
        t0 = time.perf_counter()
        fs = FilesystemTier(root, layout, direct=False)
        try:
            with TieredCache(layout, config, secondaries=[fs]) as cache:
                ready_s = time.perf_counter() - t0
                conn = Connector(cache)
                during = _lookups(conn, tokens, lambda ms: fs.scanned.is_set())
                scan_s = time.perf_counter() - t0
                after = _lookups(conn, tokens, lambda ms: len(ms) >= requests)
                fs.wait_discovered(60)
                background_stats = fs.stats["disk_lookups"]
        finally:
            fs.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"pages": pages, "files": files, "prompt_tokens": tokens, "block_tokens": B,
            "ready_s": ready_s, "scan_s": scan_s,
            "during_scan": _figures(during), "after_scan": _figures(after), "ram_only": _figures(ram_only),
            "background_stats": background_stats}


def table(result: dict) -> str:
    lines = [f"Cold {result['prompt_tokens']:,}-token prompts ({result['prompt_tokens'] // result['block_tokens']} "
             f"keys each, all misses) on a store of {result['pages']:,} packed pages and {result['files']:,} "
             f"page files. The cache waited {result['ready_s']:.2f} s at start-up for the pack tables; "
             f"the whole scan took {result['scan_s']:.1f} s. The lookup is `Connector.begin`, which "
             "vLLM's scheduler thread waits for:\n",
             "| when | lookups | p50 | p99 | max |", "|---|---:|---:|---:|---:|"]
    for label, key in (("during the rest of the start-up scan", "during_scan"), ("after it", "after_scan"),
                       ("ceiling: RAM only, no disk tier", "ram_only")):
        f = result[key]
        if f is None:
            lines.append(f"| {label} | 0 (it ended before the first lookup) | | | |")
            continue
        lines.append(f"| {label} | {f['lookups']} | {f['p50_ms']:.2f} ms | {f['p99_ms']:.2f} ms | {f['max_ms']:.2f} ms |")
    lines.append(f"\nThe keys those lookups missed were looked for by the tier's background job "
                 f"({result['background_stats']:,} `stat`s), off the scheduler thread.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridkv.tools.bench_lookup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=200_000)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--out", default="docs/bench_lookup.json")
    args = ap.parse_args(argv)
    if min(args.pages, args.files, args.tokens, args.requests) < 1:
        ap.error("--pages, --files, --tokens and --requests must be at least 1")
    result = measure(args.pages, args.files, args.tokens, args.requests)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
