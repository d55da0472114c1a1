"""One arena shared by attention pages and states: segments move to the kind that needs them,
pages keep their bytes when their segment moves, and nothing moves that one LRU order would
not have evicted first."""

import numpy as np
import pytest

from hybridkv.cache import TieredCache, store_pages
from hybridkv.config import CacheConfig
from hybridkv.core.errors import HybridKVError
from hybridkv.core.planner import plan_pools
from hybridkv.ram.arena import MIN_SEGMENTS, Arena
from hybridkv.ram.grouped_pools import MOVE_MARGIN

from helpers.tier_worker import LAYOUT, key, load_now, page

SEGMENT = 16384                  # lcm of the layout's pages: 4 attention pages or 1 state
KV_ROWS = SEGMENT // LAYOUT.group(0).page_bytes


def cache_of(tmp_path, segments=24, **settings):
    config = CacheConfig(block_tokens=16, ram_bytes=segments * SEGMENT, ram_dir=str(tmp_path),
                         reference_tokens=64, tail_states=0, **settings)
    return TieredCache(LAYOUT, config)


def fill(cache, gid, keys):
    assert store_pages(cache, {gid: [(key(i), page(gid, i)) for i in keys]})


def test_the_arena_starts_from_the_planned_split_in_whole_segments():
    plan = plan_pools(LAYOUT, 24 * SEGMENT, 0, 64)
    arena = Arena.for_plan(plan, LAYOUT)
    assert arena.segments == 24 and arena.segment_bytes == SEGMENT
    assert arena.capacity(0) <= plan.token_slots and arena.capacity(1) <= plan.groups[1].slots
    assert arena.unit("state") == (1, 1) and arena.unit("token") == (1, 1)
    owned = sorted(s for segs in arena.owned.values() for s in segs) + arena.unowned
    assert sorted(owned) == list(range(24))
    assert Arena.for_plan(plan_pools(LAYOUT, (MIN_SEGMENTS - 1) * SEGMENT, 0, 64), LAYOUT) is None


def test_states_take_a_segment_whose_attention_pages_keep_their_bytes(tmp_path):
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


def test_a_static_split_keeps_the_plan(tmp_path):
    with cache_of(tmp_path, ram_split="static") as cache:
        assert cache.stats()["arena"] is None
        assert cache.pools.pool(0).capacity == cache.plan.token_slots
    with pytest.raises(HybridKVError, match="ram_split 'half' is unknown; use shared"):
        CacheConfig(ram_split="half")
