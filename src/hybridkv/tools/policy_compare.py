"""Every state policy on one trace and the same RAM budgets, beside the ceilings that bound them.

The attention-only ceiling at equal bytes replays the trace with state pages costing nothing
(all bytes go to attention pages and every boundary has a state), under plain LRU and under the
learned insertion, and keeps the better: no state policy can do better at that budget. The
unlimited ceiling is what the trace's repeated prefixes allow at all. Marconi's weight between recency and FLOPs saved is tuned per budget on the first part
of the trace, as its paper bootstraps it. The recommended policy also runs as a cache with
no ``reference_tokens`` plans RAM (for prompts of the model's maximum length, until it has
learned the traffic's): what the setting is worth on this trace; with RAM split statically
between attention pages and states (``ram_split = static``): what the shared arena gains; and
over one budget in one LRU order without segments (``SharedBudgetPools``): what the arena's
segments cost; and storing states only where a later prompt resumes (``clairvoyant_states``):
what a better choice of states could gain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hybridkv.connector import Connector
from hybridkv.core.layout import Layout
from hybridkv.core.planner import default_reference_tokens, plan_pools
from hybridkv.tools.simulator import (
    RECOMMENDED,
    Policy,
    SimResult,
    clairvoyant_states,
    policy,
    replay,
    settings,
)

DEFAULT_POLICIES = ("dense", "vllm-align", "semantic", "semantic-tail", "periodic-4096", "periodic-16384",
                    "semantic-aligned", "aligned-periodic-8192", "marconi", RECOMMENDED)
MARCONI_ALPHAS = (0.0, 0.5, 1.0, 2.0, 4.0)
TUNING_SHARE = 0.15


@dataclass
class Comparison:
    workload: str
    budgets: list[int]
    results: dict[str, list[SimResult]]     # policy -> one result per budget
    ceiling: list[SimResult]                # attention-only at equal bytes
    share_ceiling: list[SimResult]          # attention-only at the recommended plan's KV bytes
    attention_share: list[float]            # of each budget, the recommended plan's KV pages
    at_default_reference: list[SimResult]   # the recommended policy without reference_tokens
    default_reference: int                  # what RAM is planned for then, until it is learned
    shared_budget: list[SimResult]          # the recommended policy over one budget, one LRU order
    static_split: list[SimResult]           # the recommended policy with ram_split = static
    clairvoyant: list[SimResult]            # the recommended policy storing only the states later used
    recommended: str = RECOMMENDED

    @property
    def ceiling_unlimited(self) -> float:
        return self.ceiling[0].unlimited_rate

    def best(self) -> list[str]:
        """The policy with the highest token hit rate per budget (the recommended one on ties)."""
        out = []
        for i in range(len(self.budgets)):
            rates = {name: rs[i].token_hit_rate for name, rs in self.results.items()}
            top = max(rates, key=rates.get)
            out.append(self.recommended if rates[self.recommended] >= rates[top] else top)
        return out

    def wrong_hits(self) -> int:
        return sum(r.wrong_hits for rs in self.results.values() for r in rs) + sum(r.wrong_hits for r in self.ceiling)

    def to_json(self) -> dict:
        return {
            "workload": self.workload, "budgets": self.budgets,
            "policies": {name: {"token_hit_rate": [r.token_hit_rate for r in rs],
                                "wrong_hits": sum(r.wrong_hits for r in rs),
                                "prefill_tokens_saved": [r.prefill_tokens_saved for r in rs],
                                "flops_saved": [r.flops_saved for r in rs],
                                "bytes_per_hit_token": [r.bytes_per_hit_token for r in rs]}
                         for name, rs in self.results.items()},
            "ceiling_equal_bytes": [r.token_hit_rate for r in self.ceiling],
            "ceiling_unlimited": self.ceiling_unlimited,
            "recommended_attention_share": self.attention_share,
            "ceiling_at_recommended_attention_bytes": [r.token_hit_rate for r in self.share_ceiling],
            "recommended": self.recommended, "best": self.best(),
            "best_settings": [changed_settings(name) for name in self.best()],
            "learned_state_align": [r.state_align_tokens for r in self.results[self.recommended]],
            "default_reference_tokens": self.default_reference,
            "recommended_at_default_reference": [r.token_hit_rate for r in self.at_default_reference],
            "learned_reference_tokens": [r.reference_tokens for r in self.at_default_reference],
            "recommended_shared_budget": [r.token_hit_rate for r in self.shared_budget],
            "recommended_static_split": [r.token_hit_rate for r in self.static_split],
            "recommended_clairvoyant_states": [r.token_hit_rate for r in self.clairvoyant],
            "requests": self.ceiling[0].requests, "prompt_tokens": self.ceiling[0].prompt_tokens,
        }


def changed_settings(name: str) -> dict | None:
    """What to set, beyond the defaults, for the cache to keep what policy ``name`` keeps;
    None where no setting does (see ``settings``)."""
    wanted, default = settings(policy(name)), settings(policy(RECOMMENDED))
    return None if wanted is None else {k: v for k, v in wanted.items() if v != default[k]}


def _how_to_run(name: str, changed: dict | None) -> str:
    if changed is None:
        return f"{name} (not a cache setting)"
    return f"{name} ({', '.join(f'{k} = {v}' for k, v in changed.items()) or 'the defaults'})"


def _tuned_marconi(layout: Layout, prompts: Sequence[np.ndarray], budget: int, reference_tokens: int) -> Policy:
    """Marconi's alpha with the most FLOPs saved on the first part of the trace."""
    head = prompts[: max(1, int(len(prompts) * TUNING_SHARE))]
    base = policy("marconi")
    best = max(MARCONI_ALPHAS, key=lambda a: replay(layout, head, budget, dataclasses.replace(base, alpha=a),
                                                     reference_tokens=reference_tokens).flops_saved)
    return dataclasses.replace(base, alpha=best)


def compare(layout: Layout, prompts: Sequence[np.ndarray], budgets: Sequence[int], workload: str = "",
            reference_tokens: int = 8192, policies: Sequence[str] = DEFAULT_POLICIES,
            progress: bool = False) -> Comparison:
    """Replay ``prompts`` under every policy and budget, the attention-only ceiling at equal
    bytes, and the same ceiling at the bytes the recommended plan gives KV pages (what bounds
    any policy that must also pay for its states)."""
    names = list(dict.fromkeys([*policies, RECOMMENDED]))
    rec = policy(RECOMMENDED)
    shares = [plan_pools(layout, b, rec.interval(layout.block_tokens), reference_tokens, None, rec.tail).token_slots
              * layout.block_bytes
              for b in budgets]
    kv_only = [Policy("attention-only ceiling", states=False, insertion=insertion) for insertion in ("warm", "adaptive")]
    # (result row, policy, budget, reference_tokens: None as a cache not told it, shared budget, connector)
    runs = [(name, name, b, reference_tokens, False, Connector) for name in names for b in budgets]
    runs += [(f"ceiling {i}", pol, b, reference_tokens, False, Connector) for i, pol in enumerate(kv_only)
             for b in budgets]
    runs += [("unset", RECOMMENDED, b, None, False, Connector) for b in budgets]
    runs += [("shared", RECOMMENDED, b, reference_tokens, True, Connector) for b in budgets]
    static = dataclasses.replace(rec, ram_split="static")
    runs += [("static", static, b, reference_tokens, False, Connector) for b in budgets]
    clairvoyant = clairvoyant_states(prompts, layout.block_tokens)
    runs += [("clairvoyant", RECOMMENDED, b, reference_tokens, False, clairvoyant) for b in budgets]
    runs += [(f"share {i}", pol, b, reference_tokens, False, Connector) for i, pol in enumerate(kv_only)
             for b in shares]
    rows = [*names, "ceiling 0", "ceiling 1", "share 0", "share 1", "unset", "shared", "static", "clairvoyant"]
    results: dict[str, list[SimResult]] = {name: [] for name in rows}
    for row, pol, budget, reference, shared, connector in tqdm(runs, desc=workload or "compare", unit="run",
                                                               disable=not progress):
        if pol == "marconi":
            pol = _tuned_marconi(layout, prompts, budget, reference_tokens)
        elif isinstance(pol, str):
            pol = policy(pol)
        results[row].append(replay(layout, prompts, budget, pol, workload, reference, connector, progress,
                                   shared))
    ceiling, share = (_better(results.pop(f"{row} 0"), results.pop(f"{row} 1")) for row in ("ceiling", "share"))
    return Comparison(workload, list(budgets), results, ceiling, share,
                      [s / b for s, b in zip(shares, budgets, strict=True)], results.pop("unset"),
                      default_reference_tokens(layout), results.pop("shared"), results.pop("static"),
                      results.pop("clairvoyant"))


def _better(plain: list[SimResult], learned: list[SimResult]) -> list[SimResult]:
    """Per budget, the replay that restored more: the ceiling must bound every insertion."""
    return [max(a, b, key=lambda r: r.token_hit_rate) for a, b in zip(plain, learned, strict=True)]


def _gib(b: int) -> str:
    return f"{b / 2**30:g} GiB"


def table(c: dict) -> str:
    """Markdown from ``Comparison.to_json()``: token hit rate per policy and budget, the
    ceilings, and the recommended policy's share of the equal-bytes ceiling."""
    budgets, ceiling = c["budgets"], c["ceiling_equal_bytes"]
    lines = ["| policy | " + " | ".join(_gib(b) for b in budgets) + " | wrong hits | MiB stored per hit token |",
             "|---|" + "---:|" * (len(budgets) + 2)]
    for name, p in c["policies"].items():
        label = f"**{name}** (recommended)" if name == c["recommended"] else name
        per_token = " / ".join(f"{v / 2**20:.2f}" if r else "-" for v, r in zip(p["bytes_per_hit_token"], p["token_hit_rate"], strict=True))
        lines.append(f"| {label} | " + " | ".join(f"{r:.1%}" for r in p["token_hit_rate"])
                     + f" | {p['wrong_hits']} | {per_token} |")
    lines.append("| attention-only ceiling, equal bytes | " + " | ".join(f"{r:.1%}" for r in ceiling) + " | | |")
    lines.append(f"| unlimited ceiling | {c['ceiling_unlimited']:.1%}" + " |" * (len(budgets) + 1) + " |")
    rec = c["policies"][c["recommended"]]["token_hit_rate"]
    share = c["ceiling_at_recommended_attention_bytes"]
    lines.append("| attention-only ceiling at the KV bytes " + c["recommended"] + " keeps ("
                 + " / ".join(f"{s:.0%}" for s in c["recommended_attention_share"]) + " of the budget) | "
                 + " | ".join(f"{r:.1%}" for r in share) + " | | |")
    lines.append(f"| {c['recommended']} / equal-bytes ceiling | " + " | ".join(
        f"{r / top:.2f}x" if top else "-" for r, top in zip(rec, ceiling, strict=True)) + " | | |")
    lines.append(f"| {c['recommended']} / ceiling at its KV bytes | " + " | ".join(
        f"{r / top:.2f}x" if top else "-" for r, top in zip(rec, share, strict=True)) + " | | |")
    for field, label in (("recommended_static_split", "with RAM split statically (`ram_split = static`)"),
                         ("recommended_shared_budget", "over one budget in one LRU order, no segments (the "
                          "bound of any rule moving RAM between KV and states)"),
                         ("recommended_clairvoyant_states", "storing states only where a later prompt resumes "
                          "(clairvoyant: what a better choice of states could gain)")):
        if field in c:
            lines.append(f"| {c['recommended']} {label} | " + " | ".join(
                f"{r:.1%} ({r / top:.2f}x)" if top else f"{r:.1%}"
                for r, top in zip(c[field], ceiling, strict=True)) + " | | |")
    if "best_settings" in c:
        lines.append("| best policy (settings beyond the defaults) | " + " | ".join(
            _how_to_run(name, changed) for name, changed in zip(c["best"], c["best_settings"], strict=True))
            + " | | |")
    if "recommended_at_default_reference" in c:
        learned = " / ".join(f"{t:,}" for t in c["learned_reference_tokens"])
        lines.append(f"| {c['recommended']} without `reference_tokens` (RAM planned for "
                     f"{c['default_reference_tokens']:,}-token prompts, re-planned for {learned}) | " + " | ".join(
                         f"{r:.1%}" for r in c["recommended_at_default_reference"]) + " | | |")
    if "learned_state_align" in c:
        lines.append(f"| {c['recommended']}: prompt states at multiples of (tokens) | "
                     + " | ".join(f"{a:,}" for a in c["learned_state_align"]) + " | | |")
    return "\n".join(lines)


def plot(comparisons: Sequence[dict], path: str | Path) -> Path:
    """One panel per trace (from ``Comparison.to_json()``): token hit rate against budget per
    policy, the equal-bytes ceiling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(comparisons))
    rows = -(-len(comparisons) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(comparisons):]:
        ax.axis("off")
    for ax, c in zip(axes.flat, comparisons, strict=False):
        x = [b / 2**30 for b in c["budgets"]]
        for name, p in c["policies"].items():
            ax.plot(x, p["token_hit_rate"], marker="o", lw=2.5 if name == c["recommended"] else 1, label=name)
        ax.plot(x, c["ceiling_equal_bytes"], "k--", label="attention-only ceiling")
        ax.axhline(c["ceiling_unlimited"], color="grey", lw=0.8, ls=":", label="unlimited ceiling")
        ax.set_xscale("log", base=2)
        ax.set_title(c["workload"], fontsize=9)
        ax.set_xlabel("RAM budget (GiB)")
        ax.set_ylabel("token hit rate")
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
