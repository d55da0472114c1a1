"""Cache statistics as Prometheus text exposition (the dict form is ``Engine.stats()``)."""

from __future__ import annotations


def to_prometheus(stats: dict, prefix: str = "hybridkv") -> str:
    """Per-group pool gauges/counters, per-tier counters and connector counters."""
    lines: list[str] = []

    def emit(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        if not samples:
            return
        full = f"{prefix}_{name}"
        lines.append(f"# HELP {full} {help_text}")
        lines.append(f"# TYPE {full} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"{full}{{{label_text}}} {value}" if label_text else f"{full} {value}")

    groups = stats.get("groups", {})
    for field, kind, text in (("slots", "gauge", "slots in the group's RAM pool"),
                              ("used", "gauge", "slots holding a page"),
                              ("evictable", "gauge", "stored pages that may be evicted"),
                              ("stores", "counter", "pages stored into RAM"),
                              ("evictions", "counter", "pages evicted from RAM"),
                              ("store_refusals", "counter", "stores refused because nothing was evictable")):
        emit(f"ram_{field}" + ("_total" if kind == "counter" else ""), kind, text,
             [({"group": gid, "kind": g["kind"]}, g[field]) for gid, g in groups.items()])
    tiers = stats.get("tiers", {})
    for field, text in (("hits", "pages served from the tier"),
                        ("misses", "keys looked up in the tier and not found"), ("bytes_in", "bytes stored into the tier"),
                        ("bytes_out", "bytes served from the tier"), ("corrupt", "pages that failed verification"),
                        ("evictions", "pages evicted by the tier's quota"),
                        ("skipped_stores", "stores skipped while the tier was unavailable"),
                        ("outages", "times the tier became unreachable")):
        emit(f"tier_{field}_total", "counter", text,
             [({"tier": name}, t[field]) for name, t in tiers.items() if field in t])
    if "pending_writes" in stats:
        emit("pending_writes", "gauge", "write-through jobs not finished", [({}, stats["pending_writes"])])
    connector = dict(stats.get("connector", {}))
    if "offers_pending" in connector:
        emit("connector_offers_pending", "gauge", "page offers RAM has not taken yet",
             [({}, connector.pop("offers_pending"))])
    for field, value in connector.items():
        emit(f"connector_{field}_total", "counter", f"connector {field.replace('_', ' ')}", [({}, value)])
    return "\n".join(lines) + "\n"
