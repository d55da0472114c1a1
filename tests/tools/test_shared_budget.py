"""The shared-budget bound: groups of two page sizes drawing on one byte budget in one LRU order."""

import random

import pytest

from hybridkv.tools.shared_budget import SharedBudgetPools

KV, STATE = 0, 1
PAGE = {KV: 1, STATE: 4}


def pools(budget=8):
    return SharedBudgetPools({KV: 1, STATE: 1}, budget, PAGE)


def store(p, keys, **kw):
    plans = p.prepare_store(keys, **kw)
    if plans is not None:
        p.complete_store(keys)
    return plans


def resident(p):
    return {gid: set(p.pool(gid).resident_keys()) for gid in (KV, STATE)}


def test_a_store_evicts_the_least_recently_used_page_of_any_group():
    p = pools()
    store(p, {STATE: ["s"]})
    store(p, {KV: ["a", "b", "c", "d"]})
    p.touch({STATE: ["s"]})                      # the state is now the most recent page
    store(p, {KV: ["e"]})
    assert resident(p) == {KV: set("bcde"), STATE: {"s"}}
    p.touch({KV: ["b", "c", "d", "e"]})          # now the state is the oldest: it makes the room
    store(p, {KV: ["f"]})
    assert resident(p) == {KV: set("bcdef"), STATE: set()} and p.bytes_used() == 5


def test_room_moves_between_kinds_as_the_traffic_asks():
    p = pools()
    store(p, {KV: list("abcdefgh")})             # all of it attention pages
    store(p, {STATE: ["s1"]})
    store(p, {STATE: ["s2"]})                    # then all of it states
    assert len(p.pool(KV)) == 0 and len(p.pool(STATE)) == 2 and p.bytes_used() == 8


def test_a_spare_store_takes_free_room_only():
    p = pools()
    store(p, {KV: list("abcde")})
    assert p.free_slots(STATE) == 0
    assert p.prepare_store({STATE: ["s"]}, spare=True) is None
    assert len(p.pool(KV)) == 5                  # nothing evicted for it
    store(p, {KV: ["x"]})
    p.touch({KV: ["x"]})
    p.prepare_store({KV: ["y"]}, cold=True)      # a cold page is the first to go
    p.complete_store({KV: ["y"]})
    store(p, {KV: ["z", "w", "v"]})               # 2 bytes short: the cold page, then the oldest
    assert resident(p)[KV] == set("bcdexzwv")


def test_a_store_that_cannot_make_room_changes_nothing():
    p = pools()
    store(p, {KV: list("abcdefgh")})
    p.prepare_load({KV: list("abcde")}, "r")     # pinned: only 3 bytes could be evicted
    before = sorted(p.pool(KV).resident_keys())
    assert p.prepare_store({STATE: ["s"]}) is None
    assert sorted(p.pool(KV).resident_keys()) == before and p.pool(STATE).store_refusals == 1
    p.request_finished("r")
    store(p, {STATE: ["s"]})                     # released: the oldest four pages go
    assert resident(p) == {KV: set("bcde"), STATE: {"s"}}


def test_random_traffic_never_exceeds_the_budget():
    rng = random.Random(7)
    p = pools(budget=40)
    for i in range(3000):
        gid = rng.choice([KV, STATE])
        keys = [f"{gid}-{rng.randrange(60)}" for _ in range(rng.randint(1, 3))]
        plans = store(p, {gid: keys}, cold=rng.random() < 0.2, spare=rng.random() < 0.1)
        if plans is None:   # only a spare may be turned away: nothing is pinned
            continue
        if rng.random() < 0.3:
            resident = [k for k in keys if k in p.pool(gid)]
            p.prepare_load({gid: resident}, f"r{i}")
            p.touch({gid: resident})
            p.request_finished(f"r{i}")
        assert p.bytes_used() <= 40
        assert all(p.pool(g).evictable_count() == len(p.pool(g)) for g in (KV, STATE))


def test_pools_cannot_be_rebuilt_while_a_page_is_pinned():
    p = pools()
    store(p, {KV: ["a"]})
    p.prepare_load({KV: ["a"]}, "r")
    with pytest.raises(ValueError, match="pinned"):
        p.resize({KV: 1, STATE: 1})
