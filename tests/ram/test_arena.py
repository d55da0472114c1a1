"""One arena shared by attention pages and states: segments move to the kind that needs them,
pages keep their bytes when their segment moves, and nothing moves that one LRU order would
not have evicted first."""

import numpy as np
import pytest

from hybridkv.cache import TieredCache, store_pages
from hybridkv.config import CacheConfig
from hybridkv.core.errors import HybridKVError
from hybridkv.core.planner import plan_pools
from hybridkv.ram import relocation
from hybridkv.ram.arena import MIN_SEGMENTS, Arena
from hybridkv.ram.grouped_pools import MOVE_MARGIN

from helpers.tier_worker import LAYOUT, key, load_now, page

SEGMENT = 16384                  # lcm of the layout's pages: 4 attention pages or 1 state
KV_ROWS = SEGMENT // LAYOUT.group(0).page_bytes


def cache_of(tmp_path, segments=96, **settings):
    config = CacheConfig(block_tokens=16, ram_bytes=segments * SEGMENT, ram_dir=str(tmp_path),
                         reference_tokens=64, tail_states=0, **settings)
    return TieredCache(LAYOUT, config)


def fill(cache, gid, keys):
    assert store_pages(cache, {gid: [(key(i), page(gid, i)) for i in keys]})


def test_the_arena_starts_from_the_planned_split_in_whole_segments():
    plan = plan_pools(LAYOUT, 96 * SEGMENT, 0, 64)
    arena = Arena.for_plan(plan, LAYOUT)
    assert arena.segments == 96 and arena.segment_bytes == SEGMENT
    assert arena.capacity(0) <= plan.token_slots and arena.capacity(1) <= plan.groups[1].slots
    assert arena.unit("state") == (1, 1) and arena.unit("token") == (1, 1)
    owned = sorted(s for segs in arena.owned.values() for s in segs) + arena.unowned
    assert sorted(owned) == list(range(96))
    assert Arena.for_plan(plan_pools(LAYOUT, (MIN_SEGMENTS - 1) * SEGMENT, 0, 64), LAYOUT) is None


@pytest.mark.parametrize("threads", [1, 3])
def test_states_take_a_segment_whose_attention_pages_keep_their_bytes(tmp_path, monkeypatch, threads):
    # the move's pages are copied by one thread or several (as a move of hundreds of MiB is)
    monkeypatch.setattr(relocation, "THREADS", threads)
    monkeypatch.setattr(relocation, "PARALLEL_BYTES", 0)
    with cache_of(tmp_path) as cache:
        kv, states = cache.pools.pool(0), cache.pools.pool(1)
        n_kv, n_states = kv.capacity, states.capacity
        assert n_kv >= KV_ROWS * (MOVE_MARGIN + 1)
        fill(cache, 0, range(n_kv))                            # RAM full of attention pages...
        fill(cache, 1, range(100, 100 + n_states))             # ...and of states, all newer
        fill(cache, 1, [999])                                  # one state more: not evicting one
        assert cache.stats()["arena"]["moves"] == 1
        assert (kv.capacity, states.capacity) == (n_kv - KV_ROWS, n_states + 1)
        assert [i for i in range(n_kv) if key(i) not in kv] == list(range(KV_ROWS))   # the oldest
        assert all(key(100 + i) in states for i in range(n_states))
        assert kv.slot_of(key(n_kv - 1)) < n_kv - KV_ROWS       # its segment went: it was moved
        for i in [*range(KV_ROWS, n_kv)]:                       # moved or not, each page intact
            load, views = load_now(cache, {0: [key(i)]})
            assert np.array_equal(views[0][0], page(0, i)), i
            cache.release(load)
        load, views = load_now(cache, {1: [key(999)]})
        assert np.array_equal(views[1][0], page(1, 999))


def test_a_store_that_takes_two_units_copies_them_one_after_the_other(tmp_path, monkeypatch):
    # The second unit's moves read rows the first unit's moves wrote: copied as one parallel
    # batch, a thread could read a row before its page arrived there.
    monkeypatch.setattr(relocation, "THREADS", 3)
    monkeypatch.setattr(relocation, "PARALLEL_BYTES", 0)
    with cache_of(tmp_path) as cache:
        kv, states = cache.pools.pool(0), cache.pools.pool(1)
        n_kv = kv.capacity
        fill(cache, 0, range(n_kv))
        # the second-to-last segment's pages are the oldest: the first unit's eviction frees
        # them, the last segment's pages move there, and the second unit moves them on
        second_last = [i for i in range(n_kv) if n_kv - 2 * KV_ROWS <= kv.slot_of(key(i)) < n_kv - KV_ROWS]
        cache.touch({0: [key(i) for i in sorted(range(n_kv), key=lambda i: -kv.slot_of(key(i)))
                         if i not in second_last]})
        fill(cache, 1, range(10_000, 10_000 + states.capacity))
        batches, take = [], cache.pools.take_relocated

        def spy():
            taken = take()
            batches.extend(taken)
            return taken

        monkeypatch.setattr(cache.pools, "take_relocated", spy)
        fill(cache, 1, [998, 999])                           # one store, two units
        assert cache.stats()["arena"]["moves"] == 2 and len(batches) == 2
        for batch in batches:                                # within a transfer no row is shared
            rows = [(gid, row) for gid, src, dst in batch for row in (src, dst)]
            assert len(set(rows)) == len(rows)
        written_first = {(gid, dst) for gid, _, dst in batches[0]}
        assert any((gid, src) in written_first for gid, src, _ in batches[1])   # moved twice
        for i in range(n_kv):
            if key(i) in kv:
                load, views = load_now(cache, {0: [key(i)]})
                assert np.array_equal(views[0][0], page(0, i)), i
                cache.release(load)


def test_no_segment_moves_while_the_other_kind_holds_younger_pages(tmp_path):
    with cache_of(tmp_path) as cache:
        kv, states = cache.pools.pool(0), cache.pools.pool(1)
        n_states = states.capacity
        fill(cache, 1, range(100, 100 + n_states))
        fill(cache, 0, range(kv.capacity))                     # attention pages are the newer
        fill(cache, 1, [999])
        assert cache.stats()["arena"]["moves"] == 0
        assert states.capacity == n_states and key(100) not in states     # it evicted its own


def test_a_pinned_page_keeps_its_segment(tmp_path):
    with cache_of(tmp_path) as cache:
        kv, states = cache.pools.pool(0), cache.pools.pool(1)
        n_kv = kv.capacity
        fill(cache, 0, range(n_kv))
        fill(cache, 1, range(100, 100 + states.capacity))
        last = [i for i in range(n_kv) if kv.slot_of(key(i)) == n_kv - 1]     # in the last segment
        load, _ = load_now(cache, {0: [key(last[0])]})
        fill(cache, 1, [999])
        assert cache.stats()["arena"]["moves"] == 0 and kv.capacity == n_kv
        cache.release(load)


def test_a_spare_state_takes_free_room_only(tmp_path):
    with cache_of(tmp_path) as cache:
        fill(cache, 0, range(cache.pools.pool(0).capacity))
        fill(cache, 1, range(100, 100 + cache.pools.pool(1).capacity))
        assert cache.prepare_store({1: [key(999)]}, spare=True) is None
        assert cache.stats()["arena"]["moves"] == 0


@pytest.mark.parametrize("free_kv", [(MOVE_MARGIN + 1) * KV_ROWS, (MOVE_MARGIN + 1) * KV_ROWS - 1])
def test_a_spare_state_grows_its_kind_only_from_the_other_kinds_free_segments(tmp_path, free_kv):
    """Spare states never evict, yet must not be shut out while the attention pages sit on
    empty segments: a unit moves where their free slots alone cover it and the margin."""
    with cache_of(tmp_path) as cache:
        kv, states = cache.pools.pool(0), cache.pools.pool(1)
        n_kv, n_states = kv.capacity, states.capacity
        held = cache.prepare_store({0: [key(5000 + i) for i in range(free_kv)]})    # the lowest slots...
        fill(cache, 0, range(n_kv - free_kv))                                    # ...the rest, the last segment too
        cache.complete_store(held, ok=False)                                     # free room lies low
        fill(cache, 1, range(100, 100 + n_states))
        last = [i for i in range(n_kv - free_kv) if kv.slot_of(key(i)) >= n_kv - KV_ROWS]
        enough = free_kv >= (MOVE_MARGIN + 1) * KV_ROWS
        assert (cache.free_slots(1) > 0) == enough
        plans = cache.prepare_store({1: [key(999)]}, spare=True)
        assert (plans is not None) == enough
        if plans is None:
            assert cache.stats()["arena"]["moves"] == 0 and states.capacity == n_states
            return
        cache.write(1, plans[1].slots[0], page(1, 999))
        cache.complete_store(plans)
        assert cache.stats()["arena"]["moves"] == 1
        assert (kv.capacity, states.capacity) == (n_kv - KV_ROWS, n_states + 1)
        assert all(key(i) in kv for i in range(n_kv - free_kv))            # no page evicted
        assert last and all(kv.slot_of(key(i)) < n_kv - KV_ROWS for i in last)   # moved out of the unit
        assert all(key(100 + i) in states for i in range(n_states))
        for gid, i in [*((0, i) for i in range(n_kv - free_kv)), (1, 999)]:
            load, views = load_now(cache, {gid: [key(i)]})
            assert np.array_equal(views[gid][0], page(gid, i)), (gid, i)
            cache.release(load)


def test_a_static_split_keeps_the_plan(tmp_path):
    with cache_of(tmp_path, ram_split="static") as cache:
        assert cache.stats()["arena"] is None
        assert cache.pools.pool(0).capacity == cache.plan.token_slots
    with pytest.raises(HybridKVError, match="ram_split 'half' is unknown; use shared"):
        CacheConfig(ram_split="half")


def test_random_traffic_keeps_every_page_intact_across_moves(tmp_path):
    """Stores of both kinds in shifting proportions, hits, pins held across stores: segments
    change hands many times, and every resident page still reads back its own bytes from a
    row no other page of its group holds."""
    import random

    rng = random.Random(3)
    with cache_of(tmp_path, segments=MIN_SEGMENTS) as cache:
        held = []
        for step in range(1500):
            states_share = 0.8 if (step // 300) % 2 else 0.2        # the traffic's mix shifts
            gid = 1 if rng.random() < states_share else 0
            i = rng.randrange(400)
            if rng.random() < 0.3 and key(i) in cache.pools.pool(gid):
                load, _ = load_now(cache, {gid: [key(i)]})
                cache.touch({gid: [key(i)]})
                held.append(load)
            else:
                store_pages(cache, {gid: [(key(i), page(gid, i))]})
            if held and rng.random() < 0.4:
                cache.release(held.pop(0))
        for load in held:
            cache.release(load)
        assert cache.stats()["arena"]["moves"] >= 10
        spans = []                                                # bytes of the arena each page holds
        for gid in (0, 1):
            size = LAYOUT.group(gid).page_bytes
            spans += [(cache.pools.slot_of(gid, k) * size, size) for k in cache.pools.pool(gid).resident_keys()]
        spans.sort()
        assert all(start + size <= following for (start, size), (following, _) in zip(spans, spans[1:], strict=False))
        for gid in (0, 1):
            pool = cache.pools.pool(gid)
            rows = [cache.pools.slot_of(gid, k) for k in pool.resident_keys()]
            assert len(set(rows)) == len(rows) and all(r < cache.regions[gid].slots for r in rows)
            for k in pool.resident_keys():
                load, views = load_now(cache, {gid: [k]})
                assert np.array_equal(views[gid][0], page(gid, int.from_bytes(k, "big")))
                cache.release(load)


def test_the_segments_in_use_are_mapped_and_no_others(tmp_path):
    """Each segment a pool uses is mapped in the background (small pages make thousands of
    segments: runs of adjacent ones go as one job), and none beyond."""
    import time

    from hybridkv.ram.regions import SharedRegion

    from helpers.smaps import mapped_bytes

    path = tmp_path / "hybridkv-arena"
    arena = SharedRegion.create(path, 64, SEGMENT)
    try:
        arena.map_segments(list(range(10)), SEGMENT)
        arena.map_segments([*range(12), 20, 21, 40], SEGMENT)
        deadline = time.monotonic() + 60
        while mapped_bytes(path) < 15 * SEGMENT and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mapped_bytes(path) == 15 * SEGMENT
    finally:
        arena.close()
