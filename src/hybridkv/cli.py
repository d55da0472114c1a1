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
