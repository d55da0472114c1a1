"""The ``hybridkv`` command line: a thin layer over the library.

Every user mistake is a HybridKVError, printed as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

from hybridkv.config import CacheConfig
from hybridkv.core.errors import HybridKVError
from hybridkv.core.requests import all_token_ids, check_max_new_tokens, check_salt
from hybridkv.core.sizes import format_size, parse_size


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own misuse path: one line, status 2
        self.exit(2, f"hybridkv: error: {message} (see '{self.prog} --help')\n")


def _cmd_plan(args) -> int:
    from hybridkv.config import load_layout, parse_retention
    from hybridkv.core.planner import plan_pools
    from hybridkv.core.retention import resolve_interval

    layout = load_layout(args.layout)
    plan = plan_pools(
        layout, parse_size(args.budget, "--budget"),
        resolve_interval(parse_retention(args.retention), layout.block_tokens),
        args.reference_tokens, args.engine_block_tokens,
    )
    if args.json:
        print(json.dumps(plan.to_dict()))
        return 0
    retention = "dense" if plan.retention is None else plan.retention
    print(f"model {layout.model}: block {plan.block_tokens} tokens, budget "
          f"{format_size(plan.budget_bytes)}, retention {retention}, reference {plan.reference_tokens} tokens")
    print(f"{'group':>5}  {'kind':<15} {'page bytes':>14} {'slots':>7} {'bytes':>14}")
    for g in plan.groups:
        print(f"{g.id:>5}  {g.kind:<15} {g.page_bytes:>14,} {g.slots:>7} {g.bytes:>14,}")
    print(f"token slots {plan.token_slots} = {plan.contexts:.2f} contexts of {plan.reference_tokens} "
          f"tokens; {format_size(plan.bytes_used)} of {format_size(plan.budget_bytes)} used")
    return 0


def _cmd_inspect(args) -> int:
    from hybridkv.tiers.admin import inspect_store

    if args.store is None and args.remote is None:
        raise HybridKVError("inspect needs --store DIR or --remote URL")
    result = inspect_store(args.store) if args.store else {"total_bytes": 0, "namespaces": []}
    if args.remote:
        from hybridkv.tiers.remote import inspect_remote
        result["remote"] = inspect_remote(args.remote)
    if args.json:
        print(json.dumps(result))
        return 0
    for ns in result["namespaces"]:
        print(f"namespace {ns['fingerprint']}  model {ns['model']}  {format_size(ns['total_bytes'])}"
              f"  quarantined {ns['quarantined']}")
        for g in ns["groups"]:
            print(f"  group {g['id']:>3} {g['kind']:<15} {g['files']:>8} files {format_size(g['bytes']):>12}")
        packs = ns["packs"]
        if packs["files"]:
            print(f"  packs {packs['files']:>8} files, {packs['pages']} pages: {format_size(packs['live_bytes'])} "
                  f"served, {format_size(packs['dead_bytes'])} dead (a reclaim pass removes or compacts them)")
    if args.store:
        print(f"total {format_size(result['total_bytes'])}")
    if "remote" in result:
        r = result["remote"]
        print(f"remote {r['url']}: {r['keys']} keys, {format_size(r['bytes'])}")
    return 0


def _cmd_verify(args) -> int:
    from hybridkv.tiers.admin import verify_store

    result = verify_store(args.store, progress=not args.json)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"checked {result['checked']}: {result['ok']} ok, {result['corrupt']} corrupt "
              f"(moved to quarantine), {result['unreadable']} unreadable (left in place), "
              f"{result['vanished']} removed meanwhile")
    return 1 if result["corrupt"] or result["unreadable"] else 0


def _cmd_gc(args) -> int:
    from hybridkv.tiers.admin import gc_store

    if args.max_bytes is None and args.unused_days is None:
        raise HybridKVError("gc needs --max-bytes SIZE, --unused-days N or both")
    if args.unused_days is not None and not args.unused_days >= 0:
        raise HybridKVError(f"--unused-days must be a number of days >= 0, got {args.unused_days}")
    max_bytes = None if args.max_bytes is None else parse_size(args.max_bytes, "--max-bytes")
    result = gc_store(args.store, max_bytes, args.unused_days, progress=not args.json)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"removed {len(result['removed_namespaces'])} unused namespaces and {result['removed_files']} "
              f"files, freed {format_size(result['freed_bytes'])}; store now {format_size(result['total_bytes'])}")
    return 0


def _cache_config(args):
    from hybridkv.config import load_config

    return load_config(args.config, overrides={f.name: getattr(args, f.name) for f in fields(CacheConfig)})


REQUEST_FIELDS = ("prompt", "prompt_ids", "max_new_tokens", "salt")


def _read_text(path: str, what: str) -> str:
    from pathlib import Path

    try:
        return Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise HybridKVError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise HybridKVError(f"{what} {path} is not UTF-8 text (byte {e.start}); re-encode it as UTF-8") from None


def _parse_ids(text: str, where: str) -> list[int]:
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in text.split()]
    except ValueError:
        raise HybridKVError(f"{where}: expected a JSON list or whitespace-separated token ids") from None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise HybridKVError(f"{where}: token ids must all be integers")
    return ids


def _check_request(item, where: str) -> dict:
    """The shape of one JSONL request; what depends on the model is checked by Engine.check."""
    if not isinstance(item, dict) or ("prompt" in item) == ("prompt_ids" in item):
        raise HybridKVError(f"{where}: needs exactly one of \"prompt\" or \"prompt_ids\"")
    unknown = sorted(set(item) - set(REQUEST_FIELDS))
    if unknown:
        raise HybridKVError(f"{where}: unknown field(s) {unknown}; known: {', '.join(REQUEST_FIELDS)}")
    if "prompt" in item and not isinstance(item["prompt"], str):
        raise HybridKVError(f"{where}: prompt must be a string; use prompt_ids for token ids")
    ids = item.get("prompt_ids")
    if ids is not None and not (isinstance(ids, list) and all_token_ids(ids)):
        raise HybridKVError(f"{where}: prompt_ids must be a list of integers")
    if "max_new_tokens" in item:
        check_max_new_tokens(item["max_new_tokens"], f"{where}: ")
    check_salt(item.get("salt"), f"{where}: ")
    return item


def _read_requests(args) -> list[tuple[str, dict]]:
    """All requests with where each came from, their shape validated before any model loads."""
    if args.prompt is not None:
        return [("", {"prompt": args.prompt})]
    if args.prompt_ids is not None:
        ids = _parse_ids(_read_text(args.prompt_ids, "prompt file"), args.prompt_ids)
        return [(f"{args.prompt_ids}: ", {"prompt_ids": ids})]
    requests = []
    for number, line in enumerate(_read_text(args.requests, "requests file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise HybridKVError(f"{args.requests} line {number}: not valid JSON ({e.msg})") from None
        where = f"{args.requests} line {number}"
        requests.append((f"{where}: ", _check_request(item, where)))
    if not requests:
        raise HybridKVError(f"{args.requests} holds no requests")
    return requests


def _quiet_transformers() -> None:
    import logging
    import warnings

    logging.basicConfig(level=logging.WARNING, format="hybridkv: %(message)s")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        raise HybridKVError("the reference engine needs transformers: pip install 'hybridkv[hf]'") from None
    warnings.filterwarnings("ignore", module=r"transformers(\.|$)")


def _cmd_generate(args) -> int:
    from hybridkv.engine.engine import Engine

    config = _cache_config(args)
    requests = _read_requests(args)
    _quiet_transformers()
    with Engine(args.model, config, use_cache=not args.no_cache, dtype=args.dtype) as engine:
        runs = []
        for where, item in requests:          # every request checked before the first runs
            prompt = item.get("prompt_ids", item.get("prompt"))
            n = item.get("max_new_tokens", args.max_new_tokens)
            try:
                runs.append((engine.check(prompt, n, item.get("salt")), n, item.get("salt")))
            except HybridKVError as e:
                raise HybridKVError(f"{where}{e}") from None
        for ids, n, salt in runs:
            result = engine.generate(ids, n, salt=salt)
            if args.json:
                print(json.dumps(result.to_dict()), flush=True)
            else:
                source = ", ".join(f"{k} {v}" for k, v in result.loaded_pages.items() if v) or "none"
                print(f"request {result.request}: {result.prompt_tokens} tokens, {result.hit_tokens} "
                      f"restored (pages from {source}), {result.computed_tokens} computed, "
                      f"TTFT {result.ttft_s * 1000:.1f} ms")
                print(f"  output: {engine.decode(result.output_token_ids)!r}", flush=True)
        if args.stats and engine.cache is not None:
            from hybridkv.tools.metrics import to_prometheus

            engine.cache.drain()
            stats = engine.stats()
            print(json.dumps({"stats": stats}) if args.stats == "json" else to_prometheus(stats), end="\n")
    return 0


def _cmd_demo(args) -> int:
    from hybridkv.tools.demo import main_demo

    if args.prompt_tokens < 4 * 64:
        raise HybridKVError("--prompt-tokens must be at least 256 for the demo to show anything")
    _quiet_transformers()
    return main_demo(args)


def _cmd_bench(args) -> int:
    from hybridkv.tools.bench import run_bench
    from hybridkv.tools.bench_report import plot, tables

    if args.manager_slots is not None and args.manager_slots < 1024:
        raise HybridKVError("--manager-slots must be at least 1024")
    if args.ram_dir is not None and not os.path.isdir(args.ram_dir):
        raise HybridKVError(f"--ram-dir {args.ram_dir} is not a directory; give a tmpfs directory such as /dev/shm")
    _quiet_transformers()
    started = time.monotonic()

    def progress(message: str) -> None:   # stderr, also under --json: a full run takes minutes
        print(f"bench [{time.monotonic() - started:5.0f} s]: {message} ...", file=sys.stderr, flush=True)

    results = run_bench(args.quick, args.remote, args.manager_slots, progress, args.ram_dir)
    if args.plot:
        for path in plot(results, args.plot):
            progress(f"wrote {path}")
    if args.json:
        print(json.dumps(results))
    else:
        print(tables(results))
    return 0


def _cmd_models(args) -> int:
    from hybridkv.engine.models import describe_builtins

    models = describe_builtins()
    if args.json:
        print(json.dumps(models))
    else:
        for m in models:
            print(f"{m['name']:<22} {m['family']:<18} attention layers {m['attention_layers']}, "
                  f"state layers {m['state_layers']}")
    return 0


def _cmd_layout(args) -> int:
    from hybridkv.engine.engine import Engine

    _quiet_transformers()
    engine = Engine(args.model, CacheConfig(block_tokens=args.block_tokens), use_cache=False,
                    dtype=args.dtype)
    print(engine.layout.to_json())
    return 0


def _cmd_simulate(args) -> int:
    from hybridkv.config import load_layout
    from hybridkv.tools import policy_compare
    from hybridkv.tools.simulator import policy, reference_tokens, replay, workload_prompts
    from hybridkv.tools.traces import read_trace

    if bool(args.trace) == bool(args.workload):
        raise HybridKVError("give either --trace PATH or --workload NAME")
    if (args.policy or args.compare) and (args.retention is not None or args.eviction != "lru"
                                          or args.insertion is not None or args.no_spare_states
                                          or args.ram_split is not None):
        raise HybridKVError("--retention, --eviction, --insertion, --no-spare-states and --ram-split change the "
                            "default policy; leave them out with --policy or --compare (e.g. --policy periodic-4096)")
    if args.layout:
        layout = load_layout(args.layout)
    elif args.model:
        from hybridkv.engine.engine import Engine

        _quiet_transformers()
        layout = Engine(args.model, CacheConfig(block_tokens=args.block_tokens), use_cache=False).layout
    else:
        layout = load_layout(Path(__file__).resolve().parents[1] / "data" / "qwen3-next-80b-a3b.json")
    budgets = [parse_size(b, "--ram-bytes") for b in args.ram_bytes.split(",") if b.strip()]
    if not budgets:
        raise HybridKVError("--ram-bytes is empty; give a size or a comma list, e.g. 32GiB,128GiB")
    if args.trace:
        name = os.path.basename(args.trace)
        prompts = [r.tokens for r in read_trace(args.trace, args.trace_format, args.trace_block_tokens)]
    else:
        name, prompts = args.workload, workload_prompts(args.workload)
    reference = args.reference_tokens or reference_tokens(prompts, layout.block_tokens)
    if args.compare:
        policies = args.policies.split(",") if args.policies else policy_compare.DEFAULT_POLICIES
        for p in policies:
            policy(p)               # unknown names fail before hours of replay
        c = policy_compare.compare(layout, prompts, budgets, name, reference, policies,
                                   progress=not args.json)
        if args.plot:
            policy_compare.plot([c.to_json()], args.plot)
        print(json.dumps(c.to_json()) if args.json else policy_compare.table(c.to_json()))
        return 1 if c.wrong_hits() else 0
    from hybridkv.config import parse_retention

    pol = policy(args.policy or policy_compare.RECOMMENDED)
    if not args.policy:           # the default, with what --retention, --eviction, --insertion, ... change
        changed = dataclasses.replace(pol, eviction=args.eviction, retention=pol.retention if args.retention is None
                                      else parse_retention(args.retention),
                                      insertion=args.insertion or pol.insertion,
                                      spare=pol.spare and not args.no_spare_states,
                                      ram_split=args.ram_split or pol.ram_split)
        pol = pol if changed == pol else dataclasses.replace(changed, name="custom")
    rows = [replay(layout, prompts, b, pol, name, reference, progress=not args.json).to_dict() for b in budgets]
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{name}: {rows[0]['requests']:,} requests, {rows[0]['prompt_tokens']:,} prompt tokens, "
              f"policy {pol.name}, unlimited ceiling {rows[0]['servable_tokens'] / max(1, rows[0]['prompt_tokens']):.1%}")
        for r in rows:
            print(f"  {format_size(r['budget_bytes']):>10}: hit rate {r['token_hit_rate']:.1%}, "
                  f"{r['prefill_tokens_saved']:,} tokens and {r['flops_saved']:.3g} FLOPs saved, "
                  f"{r['bytes_per_hit_token'] / 2**20:.2f} MiB stored per hit token, wrong hits {r['wrong_hits']}, "
                  f"prompt states at multiples of {r['state_align_tokens']:,} tokens")
    return 1 if any(r["wrong_hits"] for r in rows) else 0


def _add_cache_flags(p) -> None:
    """One flag per CacheConfig field, documented by the field; the config validates values."""
    p.add_argument("--config", help="TOML or JSON file with cache settings")
    for f in fields(CacheConfig):
        p.add_argument("--" + f.name.replace("_", "-"), help=f.metadata["help"])


def build_parser() -> argparse.ArgumentParser:
    from hybridkv import __version__

    parser = _Parser(prog="hybridkv", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hybridkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="size the RAM pools of a layout for a byte budget")
    p.add_argument("--layout", required=True, help="layout JSON file (see docs/layout.md)")
    p.add_argument("--budget", required=True, help="bytes per worker, e.g. 4GiB")
    p.add_argument("--retention", default="auto", help="auto (default: a state every ~16K tokens), 0, N tokens or dense")
    p.add_argument("--reference-tokens", type=_positive_int, help="typical request length (default: max_model_len)")
    p.add_argument("--engine-block-tokens", type=_positive_int, help="the engine's own block size, to check")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("inspect", help="what a store holds, per namespace and group")
    p.add_argument("--store", help="filesystem store directory")
    p.add_argument("--remote", help="Redis/Valkey URL of a remote tier")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", help="check every page; quarantine corrupt ones (exit 1 if any)")
    p.add_argument("--store", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("gc", help="remove namespaces unused for N days; evict least recently used pages down to a size")
    p.add_argument("--store", required=True)
    p.add_argument("--max-bytes", help="e.g. 100GiB: the whole store's size after gc")
    p.add_argument("--unused-days", type=float, help="remove namespaces (old models or versions) not used for N days")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_gc)

    p = sub.add_parser("generate", help="run prompts through a hybrid model with the cache")
    p.add_argument("--model", default="tiny-hybrid", help="built-in name or local checkpoint dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    _add_cache_flags(p)
    p.add_argument("--no-cache", action="store_true", help="same chunking, no cache: the cold control")
    p.add_argument("--max-new-tokens", type=_positive_int, default=16)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-ids", help="file with token ids (JSON list or whitespace separated)")
    source.add_argument("--requests", help="JSONL file: {\"prompt\"|\"prompt_ids\", \"max_new_tokens\"?, \"salt\"?}")
    p.add_argument("--json", action="store_true", help="one JSON object per request")
    p.add_argument("--stats", choices=["json", "prometheus"], help="print cache statistics at the end")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("demo", help="watch the cache work: RAM, junction, restart, pressure")
    p.add_argument("--model", default="tiny-hybrid")
    p.add_argument("--store", help="keep the demo's store here (default: a temp dir)")
    p.add_argument("--prompt-tokens", type=_positive_int, default=3000)
    p.add_argument("--remote", help="also write through to this Redis/Valkey URL")
    p.add_argument("--plot", default="hybridkv-demo.png", help="PNG chart path ('' for none)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("bench", help="tier, manager, restore and workload benchmarks")
    p.add_argument("--quick", action="store_true", help="smaller sizes; under two minutes")
    p.add_argument("--remote", help="also measure a Redis/Valkey tier at this URL")
    p.add_argument("--manager-slots", type=_positive_int, help="one pool size for the manager trace (default 10K, 200K and 1M; quick 10K and 100K)")
    p.add_argument("--ram-dir", help="RAM regions of the restore benchmark here (default /dev/shm), "
                   "e.g. a tmpfs mounted with huge=within_size")
    p.add_argument("--plot", help="write PNG charts into this directory")
    p.add_argument("--json", action="store_true", help="one JSON object with a section per part")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("simulate", help="replay a trace through the cache without a model; compare state policies")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--trace", help="JSONL request trace (see --trace-format)")
    source.add_argument("--workload", help="a synthetic workload instead of a trace")
    p.add_argument("--trace-format", choices=["mooncake", "tokens"], default="mooncake",
                   help="mooncake: {timestamp, input_length, output_length, hash_ids}; tokens: {prompt_ids, session?}")
    p.add_argument("--trace-block-tokens", type=_positive_int, default=512, help="tokens per Mooncake hash id")
    p.add_argument("--layout", help="layout JSON (default: the shipped Qwen3-Next-80B-A3B layout)")
    p.add_argument("--model", help="a built-in model's layout instead (needs torch)")
    p.add_argument("--block-tokens", type=_positive_int, default=256, help="block size with --model")
    p.add_argument("--ram-bytes", default="32GiB,128GiB,512GiB", help="RAM budget, or a comma list to sweep")
    p.add_argument("--reference-tokens", type=_positive_int,
                   help="context length the pools are planned for (default: the trace's mean prompt)")
    p.add_argument("--policy", help="a named policy: dense, vllm-align, semantic, semantic-tail, semantic-aligned, periodic-N, aligned-periodic-N, marconi, or aligned-periodic (hybridkv's default, the one replayed without --policy)")
    p.add_argument("--retention", help="without --policy: the default with this retention (auto, 0, N tokens or dense)")
    p.add_argument("--eviction", default="lru", choices=["lru", "arc"], help="without --policy: the default with this eviction")
    p.add_argument("--insertion", choices=["adaptive", "warm", "cold"],
                   help="without --policy: the default with new pages entering the eviction order so")
    p.add_argument("--no-spare-states", action="store_true",
                   help="without --policy: the default keeping no states beyond its retention's in free RAM")
    p.add_argument("--ram-split", choices=["shared", "static"],
                   help="without --policy: the default with RAM shared by attention pages and states (the default) "
                        "or split as planned for the reference length")
    p.add_argument("--compare", action="store_true", help="every policy and the ceilings in one table")
    p.add_argument("--policies", help="with --compare: a comma list instead of the default set")
    p.add_argument("--plot", help="with --compare: write a PNG chart here")
    p.add_argument("--json", action="store_true", help="one JSON object (--compare) or list")
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser("models", help="list the built-in models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_models)

    p = sub.add_parser("layout", help="print a model's cache layout (input for 'plan')")
    p.add_argument("--model", default="tiny-hybrid")
    p.add_argument("--block-tokens", type=_positive_int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.set_defaults(func=_cmd_layout)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except HybridKVError as e:
        print(f"hybridkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hybridkv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
