"""Cache statistics as Prometheus text exposition (the dict form is ``Engine.stats()``).

``prometheus_client`` (the ``metrics`` extra) writes the text, so names, label escaping and
the ``_total`` suffix of counters follow the exposition format.
"""

from __future__ import annotations

from hybridkv.core.errors import HybridKVError

GROUP_FIELDS = (("slots", "gauge", "slots in the group's RAM pool"),
                ("used", "gauge", "slots holding a page"),
                ("evictable", "gauge", "stored pages that may be evicted"),
                ("stores", "counter", "pages stored into RAM"),
                ("evictions", "counter", "pages evicted from RAM"),
                ("store_refusals", "counter", "stores refused because nothing was evictable"))
TIER_FIELDS = (("hits", "pages served from the tier"),
               ("misses", "keys looked up in the tier and not found"),
               ("bytes_in", "bytes stored into the tier"),
               ("bytes_out", "bytes served from the tier"),
               ("corrupt", "pages that failed verification"),
               ("evictions", "pages evicted by the tier's quota"),
               ("skipped_stores", "stores skipped while the tier was unavailable"),
               ("outages", "times the tier became unreachable"))
CONNECTOR_GAUGES = {"offers_pending": "page offers RAM has not taken yet",
                    "state_align_tokens": "each prompt's state is kept at a multiple of this many tokens",
                    "insertion_cold": "1 while pages of requests that found under half their prompt enter RAM cold",
                    "periodic_states": "1 while retention = auto keeps a state every ~16K tokens"}


def to_prometheus(stats: dict, prefix: str = "hybridkv") -> str:
    """Per-group pool gauges/counters, per-tier counters and connector counters."""
    try:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError:
        raise HybridKVError("Prometheus output needs prometheus_client; "
                            "pip install 'hybridkv[metrics]' or use --stats json") from None
    families = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}

    def family(name: str, kind: str, text: str, labels: list[str], samples) -> object | None:
        metric = families[kind](f"{prefix}_{name}", text, labels=labels)
        for values, value in samples:
            metric.add_metric([str(getattr(v, "value", v)) for v in values], value)
        return metric if metric.samples else None

    def collect():
        groups = stats.get("groups", {})
        for field, kind, text in GROUP_FIELDS:
            yield family(f"ram_{field}", kind, text, ["group", "kind"],
                         [((gid, g["kind"]), g[field]) for gid, g in groups.items()])
        tiers = stats.get("tiers", {})
        for field, text in TIER_FIELDS:
            yield family(f"tier_{field}", "counter", text, ["tier"],
                         [((name,), t[field]) for name, t in tiers.items() if field in t])
        for field, text in (("pending_writes", "write-through jobs not finished"),
                            ("promotions_in_flight", "reads of pages into RAM not settled")):
            if field in stats:
                yield family(field, "gauge", text, [], [((), stats[field])])
        for field, value in stats.get("connector", {}).items():
            kind = "gauge" if field in CONNECTOR_GAUGES else "counter"
            text = CONNECTOR_GAUGES.get(field, f"connector {field.replace('_', ' ')}")
            yield family(f"connector_{field}", kind, text, [], [((), value)])

    class _Stats:
        def collect(self):
            return [m for m in collect() if m is not None]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Stats())
    return generate_latest(registry).decode()
