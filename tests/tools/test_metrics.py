from prometheus_client.parser import text_string_to_metric_families

from hybridkv.core.layout import GroupKind
from hybridkv.tools.metrics import to_prometheus

STATS = {
    "groups": {0: {"kind": GroupKind.STATE, "slots": 8, "used": 3, "evictable": 2, "stores": 5,
                   "evictions": 1, "store_refusals": 0}},
    "tiers": {"ram": {"hits": 4, "misses": 2}, 'odd "tier"\\\n': {"hits": 1, "corrupt": 7}},
    "pending_writes": 2,
    "promotions_in_flight": 1,
    "connector": {"requests": 3, "offers_pending": 1},
}


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_exposition_parses_back_with_escaped_labels():
    got = samples(to_prometheus(STATS))
    assert got[("hybridkv_ram_used", (("group", "0"), ("kind", "state")))] == 3
    assert got[("hybridkv_ram_stores_total", (("group", "0"), ("kind", "state")))] == 5
    assert got[("hybridkv_tier_corrupt_total", (("tier", 'odd "tier"\\\n'),))] == 7
    assert got[("hybridkv_tier_hits_total", (("tier", "ram"),))] == 4
    assert got[("hybridkv_pending_writes", ())] == 2
    assert got[("hybridkv_promotions_in_flight", ())] == 1
    assert got[("hybridkv_connector_offers_pending", ())] == 1
    assert got[("hybridkv_connector_requests_total", ())] == 3
    assert not any(name.startswith("hybridkv_tier_outages") for name, _ in got)   # absent, not 0


def test_types_follow_the_field():
    text = to_prometheus(STATS)
    assert "# TYPE hybridkv_ram_slots gauge" in text
    assert "# TYPE hybridkv_ram_evictions_total counter" in text
    assert "# TYPE hybridkv_connector_offers_pending gauge" in text
