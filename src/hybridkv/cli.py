"""The ``hybridkv`` command line: a thin layer over the library.

Every user mistake is a HybridKVError, printed as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridkv.errors import HybridKVError
from hybridkv.sizes import format_size, parse_size


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own misuse path: one line, status 2
        self.exit(2, f"hybridkv: error: {message} (see 'hybridkv {self.prog.split()[-1]} --help')\n")


def _cmd_plan(args) -> int:
    from hybridkv.config import parse_retention
    from hybridkv.layout import load_layout
    from hybridkv.planner import plan_pools

    layout = load_layout(args.layout)
    plan = plan_pools(
        layout, parse_size(args.budget, "--budget"), parse_retention(args.retention),
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
    from hybridkv.store_admin import inspect_store

    if args.store is None and args.remote is None:
        raise HybridKVError("inspect needs --store DIR or --remote URL")
    result = inspect_store(args.store) if args.store else {"total_bytes": 0, "namespaces": []}
    if args.remote:
        from hybridkv.remote_tier import inspect_remote
        result["remote"] = inspect_remote(args.remote)
    if args.json:
        print(json.dumps(result))
        return 0
    for ns in result["namespaces"]:
        print(f"namespace {ns['fingerprint']}  model {ns['model']}  {format_size(ns['total_bytes'])}"
              f"  quarantined {ns['quarantined']}")
        for g in ns["groups"]:
            print(f"  group {g['id']:>3} {g['kind']:<15} {g['files']:>8} files {format_size(g['bytes']):>12}")
    if args.store:
        print(f"total {format_size(result['total_bytes'])}")
    if "remote" in result:
        r = result["remote"]
        print(f"remote {r['url']}: {r['keys']} keys, {format_size(r['bytes'])}")
    return 0


def _cmd_verify(args) -> int:
    from hybridkv.store_admin import verify_store

    result = verify_store(args.store, progress=not args.json)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"checked {result['checked']}: {result['ok']} ok, {result['corrupt']} corrupt "
              f"(moved to quarantine)")
    return 1 if result["corrupt"] else 0


def _cmd_gc(args) -> int:
    from hybridkv.store_admin import gc_store

    result = gc_store(args.store, parse_size(args.max_bytes, "--max-bytes"), progress=not args.json)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"removed {result['removed_files']} files, freed {format_size(result['freed_bytes'])}; "
              f"store now {format_size(result['total_bytes'])}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybridkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="size the RAM pools of a layout for a byte budget")
    p.add_argument("--layout", required=True, help="layout JSON file (see docs/layout.md)")
    p.add_argument("--budget", required=True, help="bytes per worker, e.g. 4GiB")
    p.add_argument("--retention", default="0", help="dense, 0 (semantic, default) or N tokens")
    p.add_argument("--reference-tokens", type=int, help="typical request length (default: max_model_len)")
    p.add_argument("--engine-block-tokens", type=int, help="the engine's own block size, to check")
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

    p = sub.add_parser("gc", help="evict least recently used pages down to a size")
    p.add_argument("--store", required=True)
    p.add_argument("--max-bytes", required=True, help="e.g. 100GiB")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_gc)
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
