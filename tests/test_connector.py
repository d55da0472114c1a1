"""Durable page offers, driven directly through the engine-neutral connector."""

import dataclasses
import logging
import shutil
import time
from contextlib import contextmanager

import numpy as np
import pytest

from hybridkv.cache import TieredCache, store_pages
from hybridkv.config import CacheConfig
from hybridkv.connector import Connector, PageKind, ReferenceLearner, StateLookup
from hybridkv.core.retention import Retention
from hybridkv.core.shadow import ShadowCache, SharedShadowCache

from helpers.tier_worker import LAYOUT, flip_payload_byte, load_now, page

B = LAYOUT.block_tokens


@pytest.fixture
def cache():
    # 8 token slots and 2 state slots (reference 4 blocks: one request + one junction)
    budget = 8 * LAYOUT.group(0).page_bytes + 2 * LAYOUT.group(1).page_bytes
    with TieredCache(LAYOUT, CacheConfig(block_tokens=B, ram_bytes=budget, reference_tokens=8 * B, tail_states=0)) as c:
        assert c.plan.slots_per_group() == {0: 8, 1: 2}
        yield c


def disk_config(tmp_path, **settings) -> CacheConfig:
    """1 MiB of RAM in ``tmp_path`` over a disk store in ``tmp_path/s``."""
    return CacheConfig(block_tokens=B, ram_bytes=1024**2, ram_dir=str(tmp_path), store=str(tmp_path / "s"),
                       **settings)


def tokens(n, seed):
    return np.random.default_rng(seed).integers(3, 1000, n).tolist()


def fill_states(cache, conn, seeds):
    """Store and keep pinned one state per seed, so no state slot is evictable."""
    reqs = []
    for seed in seeds:
        req = conn.begin(f"pin{seed}", tokens(2 * B + 1, seed))
        conn.offer_block(req, 0, {0: page(0, seed)})
        conn.offer_block(req, 1, {0: page(0, seed + 50)})
        conn.offer_state(req, 2 * B, {1: page(1, seed)})
        assert req.stored == {"attention": 2, "state": 1}
        reqs.append(req)
    return reqs


def test_refused_state_offer_stays_pending_and_is_retried(cache):
    conn = Connector(cache)
    holders = fill_states(cache, conn, (1, 2))
    pins = {1: [r.keys[1] for r in holders]}
    held = cache.prepare_load(pins)                         # both state slots pinned
    req = conn.begin("r", tokens(2 * B + 1, 9))
    conn.offer_state(req, 2 * B, {1: page(1, 9)})
    assert list(req.pending) == [("state", 2 * B)] and req.stored["state"] == 0
    conn.step(req)
    assert list(req.pending) == [("state", 2 * B)]          # still pinned: still pending
    cache.release(held)
    conn.step(req)                                          # a later step succeeds
    assert not req.pending and req.stored["state"] == 1
    _, views = load_now(cache, {1: [req.keys[1]]})
    assert np.array_equal(views[1][0], page(1, 9))


def test_reoffer_supersedes_the_pending_offer(cache):
    conn = Connector(cache)
    holders = fill_states(cache, conn, (1, 2))
    pins = {1: [r.keys[1] for r in holders]}
    held = cache.prepare_load(pins)
    req = conn.begin("r", tokens(2 * B + 1, 9))
    conn.offer_state(req, 2 * B, {1: page(1, 7)})
    conn.offer_state(req, 2 * B, {1: page(1, 8)})           # same boundary, newer source
    assert len(req.pending) == 1 and conn.stats["offers_pending"] == 1
    cache.release(held)
    conn.step(req)
    assert conn.stats["offers_pending"] == 0
    assert np.array_equal(load_now(cache, {1: [req.keys[1]]})[1][1][0], page(1, 8))


def test_offers_pending_at_finish_are_dropped_with_a_warning(cache, caplog):
    conn = Connector(cache)
    holders = fill_states(cache, conn, (1, 2))
    cache.prepare_load({1: [r.keys[1] for r in holders]})
    req = conn.begin("r", tokens(2 * B + 1, 9))
    conn.offer_state(req, 2 * B, {1: page(1, 9)})
    assert conn.stats["offers_pending"] == 1
    with caplog.at_level(logging.WARNING):
        conn.finish(req)
    assert not req.pending and conn.stats["offers_dropped"] == 1 and conn.stats["offers_pending"] == 0
    assert "could not take; dropped" in caplog.text
    assert conn.begin("again", tokens(2 * B + 1, 9)).hit_tokens == 0


def test_finish_releases_pins_a_request_still_holds(cache):
    conn = Connector(cache)
    fill_states(cache, conn, (1,))
    req = conn.begin("reader", tokens(2 * B + 1, 1))
    assert req.hit_tokens == 2 * B
    conn.load(req)                                          # pinned, never released by the engine
    assert cache.pools.pool(1).refs_of(req.keys[1]) == 1
    conn.finish(req)
    assert cache.pools.pool(1).refs_of(req.keys[1]) == 0


def test_state_offers_follow_retention_and_caps(cache):
    conn = Connector(cache)
    conn.spare_states = False
    req = conn.begin("r", tokens(5 * B + 3, 4), max_stored_tokens=3 * B)
    assert [b for b in range(0, 6 * B, B) if conn.wants_state(req, b)] == []   # replay 5B is over the cap
    req = conn.begin("r2", tokens(5 * B + 3, 4))
    assert [b for b in range(0, 6 * B, B) if conn.wants_state(req, b)] == [5 * B]


def test_spare_states_fill_free_state_slots_and_never_evict(cache):
    conn = Connector(cache)
    first = _serve(conn, "a", tokens(5 * B + 3, 4))
    # the retention keeps the replay boundary 5B; the two free state slots took spares first,
    # and the kept state then evicted one of them (spares enter cold), not a kept state
    assert first.stored["state"] == 3 and conn.stats["spare_states"] == 2
    states = cache.pools.pool(1)
    assert first.keys[4] in states and len(states) == 2
    # the learned insertion's shadows hold what the pool holds
    assert set(conn.insertion.shadows[0].states) == set(states.resident_keys())
    second = _serve(conn, "b", tokens(5 * B + 3, 5))
    assert conn.stats["spare_states"] == 2                    # no free slot: no spare offered
    assert second.keys[4] in states and first.keys[4] in states   # both kept states stay
    third = conn.begin("c", tokens(5 * B + 3, 6))
    conn.offer_state(third, B, {1: page(1, 7)})               # offered unasked, RAM full: dropped
    assert not third.pending and conn.stats["offers_pending"] == 0 and conn.stats["offers_dropped"] == 0
    assert third.keys[0] not in states
    conn.finish(third)


def test_a_spare_state_a_hit_uses_is_written_to_disk(tmp_path):
    from hybridkv.tiers.filesystem import FilesystemTier

    fs = FilesystemTier(tmp_path / "fs", LAYOUT)
    document = tokens(4 * B, 0)
    config = CacheConfig(block_tokens=B, ram_bytes=64 * 1024**2, ram_dir=str(tmp_path), tail_states=0,
                         state_align=0)
    with TieredCache(LAYOUT, config, secondaries=[fs]) as c:
        conn = Connector(c)
        first = _serve(conn, "a", document + tokens(B + 5, 1))
        c.drain()
        assert fs.contains_many(1, first.keys[:4]) == [False] * 4     # spares stay in RAM
        branch = _serve(conn, "b", document + tokens(B + 5, 2))
        assert branch.hit_tokens == 4 * B
        c.drain()
        assert fs.contains_many(1, first.keys[:4]) == [False, False, False, True]   # the one it used


def test_a_spare_state_serves_a_branch_before_any_junction(tmp_path):
    document = tokens(4 * B, 0)
    config = CacheConfig(block_tokens=B, ram_bytes=64 * 1024**2, ram_dir=str(tmp_path), tail_states=0,
                         state_align=0)
    with TieredCache(LAYOUT, config) as spare_cache, \
            TieredCache(LAYOUT, config.replace(spare_states=False)) as plain_cache:
        hits = []
        for c in (spare_cache, plain_cache):
            conn = Connector(c)
            _serve(conn, "a", document + tokens(B + 5, 1))
            hits.append(conn.begin("b", document + tokens(B + 5, 2)).hit_tokens)
    assert hits == [4 * B, 0]          # without spares, b only learns the junction at 4B


def test_spare_states_stay_in_ram(tmp_path):
    from hybridkv.tiers.filesystem import FilesystemTier

    fs = FilesystemTier(tmp_path / "fs", LAYOUT)
    config = CacheConfig(block_tokens=B, ram_bytes=64 * 1024**2, ram_dir=str(tmp_path), tail_states=0,
                         state_align=0)
    with TieredCache(LAYOUT, config, secondaries=[fs]) as c:
        conn = Connector(c)
        req = _serve(conn, "a", tokens(3 * B + 5, 1))
        c.drain()
        assert conn.stats["spare_states"] == 2                  # at B and 2B; 3B is kept
        assert fs.contains_many(1, req.keys[:3]) == [False, False, True]
        assert fs.contains_many(0, req.keys[:3]) == [True, True, True]


def test_misses_are_counted_per_tier(tmp_path):
    from hybridkv.tiers.filesystem import FilesystemTier
    from hybridkv.tools.metrics import to_prometheus

    config = disk_config(tmp_path)
    on_disk = FilesystemTier(tmp_path / "s", LAYOUT)
    assert on_disk.write(0, b"d" * 16, page(0, 1))
    on_disk.close()
    with TieredCache(LAYOUT, config) as cache:
        assert cache.secondaries[0].wait_scanned(30)     # page files are indexed by the background scan
        store_pages(cache, {0: [(b"r" * 16, page(0, 2))]})
        assert cache.lookup(0, [b"r" * 16, b"d" * 16, b"n" * 16]) == ["ram", "fs", None]
        stats = cache.stats()
    assert stats["tiers"]["ram"]["misses"] == 2 and stats["tiers"]["fs"]["misses"] == 1
    assert 'hybridkv_tier_misses_total{tier="fs"} 1.0' in to_prometheus(stats)


def _stored_on_disk(layout, config, ids, blocks, state_at):
    """A cache that stored ``blocks`` prompt blocks of ``ids`` and the state at ``state_at``,
    drained to disk and closed: the next cache finds them on disk only."""
    with TieredCache(layout, config) as cache:
        conn = Connector(cache)
        req = conn.begin("writer", ids)
        for b in range(blocks):
            conn.offer_block(req, b, {0: page(0, b)})
        conn.offer_state(req, state_at, {1: page(1, state_at // B)})
        conn.finish(req)
        cache.drain()


@contextmanager
def restarted(tmp_path, ids, blocks, state_at, layout=LAYOUT):
    """A new cache and connector over a store holding what ``_stored_on_disk`` stores."""
    config = disk_config(tmp_path)
    _stored_on_disk(layout, config, ids, blocks, state_at)
    with TieredCache(layout, config) as cache:
        yield cache, Connector(cache)


@pytest.mark.parametrize("local_blocks", [0, 1])
def test_loaded_tokens_count_for_the_slowest_tier_of_their_pages(tmp_path, local_blocks):
    """What vLLM's prompt_tokens_cached_by_source shows: blocks 0-1 in RAM, 2-3 and the
    state on disk; the engine's own blocks count for no tier."""
    ids = tokens(4 * B + 1, 11)
    with restarted(tmp_path, ids, 4, 4 * B) as (cache, conn):
        keys = conn.begin("keys", ids).keys
        assert store_pages(cache, {0: [(keys[b], page(0, b)) for b in (0, 1)]})
        req = conn.begin("r", ids, local_tokens=local_blocks * B)
        assert req.hit.tokens == 4 * B and conn.load(req) is not None
        assert req.sources == {"ram": 2 - local_blocks, "fs": 3}
        assert req.token_sources == {"ram": (2 - local_blocks) * B, "fs": 2 * B}
        conn.finish(req)


def test_a_started_load_finished_before_its_reads_landed_pins_nothing(tmp_path):
    """An aborted vLLM request whose disk reads are in flight: finishing it detaches it from
    them; the pages still arrive and are served to the next request."""
    ids = tokens(4 * B + 1, 15)
    with restarted(tmp_path, ids, 4, 4 * B) as (cache, conn):
        req = conn.begin("aborted", ids)
        assert req.hit.tokens == 4 * B and conn.start_load(req).waiting
        conn.finish(req)
        cache.poll()
        cache.drain()
        assert all(cache.pools.pool(0).refs_of(k) == 0 for k in req.keys[:4])
        nxt = conn.begin("next", ids)
        views = conn.load(nxt)
        assert nxt.sources == {"ram": 5, "fs": 0}
        assert all(np.array_equal(views[0][b], page(0, b)) for b in range(4))
        conn.finish(nxt)


def test_a_load_whose_read_fails_looks_again_and_serves_the_shorter_hit(tmp_path):
    """Inside the lookup (no engine step to wait for) a failed read only shortens the hit."""
    ids = tokens(4 * B + 1, 16)
    config = disk_config(tmp_path, retention=2 * B, reference_tokens=8 * B)
    _stored_on_disk(LAYOUT, config, ids, 4, 4 * B)
    with TieredCache(LAYOUT, config) as cache:      # plus the state at 2B, in RAM
        conn = Connector(cache)
        keys = conn.begin("keys", ids).keys
        assert store_pages(cache, {1: [(keys[1], page(1, 2))]})
    flip_payload_byte(tmp_path / "s", 0, keys[3])     # block 3's attention page is corrupt
    with TieredCache(LAYOUT, config) as cache:
        conn = Connector(cache)
        req = conn.begin("r", ids)
        assert req.hit.tokens == 4 * B
        views = conn.load(req)
        assert req.hit.tokens == 2 * B and views is not None
        assert np.array_equal(views[1][0], page(1, 2))
        conn.finish(req)
        assert cache.pools.pool(1).refs_of(keys[1]) == 0      # nothing left pinned


def test_on_pages_sees_every_page_of_the_hit_load_serves_even_after_a_failed_read(tmp_path):
    """The engine copies what ``on_pages`` hands it as the reads land; after a failed read
    the hit shrinks, and its last attempt hands over every page of the shorter hit again."""
    ids = tokens(4 * B + 1, 17)
    config = disk_config(tmp_path, retention=2 * B, reference_tokens=8 * B)
    _stored_on_disk(LAYOUT, config, ids, 4, 4 * B)
    with TieredCache(LAYOUT, config) as cache:
        conn = Connector(cache)
        keys = conn.begin("keys", ids).keys
        assert store_pages(cache, {1: [(keys[1], page(1, 2))]})
    flip_payload_byte(tmp_path / "s", 0, keys[3])
    with TieredCache(LAYOUT, config) as cache:
        conn = Connector(cache)
        req = conn.begin("r", ids)
        calls = []
        views = conn.load(req, on_pages=lambda g, blocks, pages: calls.append((g, blocks, [p.copy() for p in pages])))
        assert req.hit.tokens == 2 * B
        last = {}                  # the last attempt's pages come last
        for group, blocks, pages in calls:
            last.update({(group, b): p for b, p in zip(blocks, pages, strict=True)})
        assert (1, 3) in last and (0, 3) not in last     # the first try's state came, block 3 never
        assert np.array_equal(last[(1, 1)], views[1][0]) and np.array_equal(last[(1, 1)], page(1, 2))
        assert all(np.array_equal(last[(0, b)], views[0][b]) for b in (0, 1))
        conn.finish(req)


def test_a_prefetching_begin_keys_and_hits_as_a_plain_one_and_reads_nothing_past_a_gap(tmp_path):
    """``begin(prefetch=True)`` keys the prompt in parts and starts each part's disk reads
    at once. Blocks 0-19 and 21-39 are on disk with the state at 10B: blocks 0-19 are read
    (the second part, 16-39, stops at the gap), the rest not, and the hit is a plain one's."""
    ids = tokens(40 * B + 1, 23)
    config = disk_config(tmp_path, reference_tokens=64 * B)
    with TieredCache(LAYOUT, config) as cache:
        keys = Connector(cache).begin("keys", ids).keys
        for b in [*range(20), *range(21, 40)]:      # one at a time: RAM holds ~200 pages
            assert store_pages(cache, {0: [(keys[b], page(0, b))]})
            cache.drain()
        assert store_pages(cache, {1: [(keys[9], page(1, 10))]})
        cache.drain()
    with TieredCache(LAYOUT, config) as cache:
        conn = Connector(cache)
        req = conn.begin("r", ids, prefetch=True)
        plain = conn.begin("plain", ids)
        assert req.keys == plain.keys == keys and req.hit == plain.hit and req.hit.tokens == 10 * B
        assert req.where == plain.where
        cache.drain()
        assert cache.secondaries[0].stats["reads"] == 20
        views = conn.load(req)
        assert all(np.array_equal(views[0][b], page(0, b)) for b in range(10))
        assert np.array_equal(views[1][0], page(1, 10))
        conn.finish(req)
        conn.finish(plain)


def test_a_state_only_model_s_tokens_come_with_its_state(tmp_path):
    from hybridkv.core.layout import layout_from_dict

    layout = layout_from_dict({"model": "state-only", "block_tokens": B, "max_model_len": 4096,
                               "groups": [{"id": 1, "kind": "state", "page_bytes": 16384}]})
    ids = tokens(3 * B + 1, 12)
    with restarted(tmp_path, ids, 0, 3 * B, layout) as (cache, conn):
        req = conn.begin("r", ids)
        assert conn.load(req) is not None
        assert req.sources == {"ram": 0, "fs": 1} and req.token_sources == {"ram": 0, "fs": 3 * B}
        conn.finish(req)


def test_forget_all_serves_no_page_stored_before_and_frees_idle_ram(tmp_path):
    """After a weight update: neither RAM nor disk serves an older page, pages in use stay
    valid for their request, and what is stored from now on hits again."""
    ids, other = tokens(4 * B + 1, 13), tokens(4 * B + 1, 14)
    config = disk_config(tmp_path)
    _stored_on_disk(LAYOUT, config, ids, 4, 4 * B)
    with TieredCache(LAYOUT, config) as cache:
        conn = Connector(cache)
        old = conn.begin("old", ids)
        assert old.hit.tokens == 4 * B
        views = conn.load(old)                       # promoted into RAM and pinned
        pinned = [np.array(v) for v in views[0]]
        conn.offer_block(conn.begin("idle", other), 0, {0: page(0, 99)})
        cache.drain()
        assert conn.forget_all() == 1                # the idle page; the pinned five stay
        assert [np.array_equal(v, p) for v, p in zip(views[0], pinned, strict=True)] == [True] * 4
        assert conn.begin("after", ids).hit.tokens == 0
        conn.finish(old)
        new = conn.begin("new", ids)
        for b in range(4):
            conn.offer_block(new, b, {0: page(0, b)})
        conn.offer_state(new, 4 * B, {1: page(1, 4)})
        conn.finish(new)
        assert conn.begin("again", ids).hit.tokens == 4 * B
        cache.drain()
    with TieredCache(LAYOUT, config) as cache:       # a restart, on the original weights
        restarted = Connector(cache).begin("restart", ids)
        assert restarted.hit.tokens == 4 * B and restarted.keys[0] == old.keys[0] != new.keys[0]


def test_a_request_looked_up_again_reuses_its_keys_and_finds_its_hit_afresh(tmp_path):
    """An engine asks again for a request it could not schedule: the keys are not made again,
    but the hit is (pages stored in between count), and a reset in between makes new keys
    (the old ones would find pages that must no longer be served)."""
    ids = tokens(2 * B + 1, 21)
    with TieredCache(LAYOUT, disk_config(tmp_path)) as cache:
        conn = Connector(cache)
        first = conn.begin("r", ids)
        conn.finish(first)
        other = conn.begin("other", ids)            # the same prompt under another id stores it
        conn.offer_block(other, 0, {0: page(0, 1)})
        conn.offer_block(other, 1, {0: page(0, 2)})
        conn.offer_state(other, 2 * B, {1: page(1, 3)})
        conn.finish(other)
        second = conn.begin("r", ids, again=first)
        assert second.keys is first.keys and second.hit.tokens == 2 * B
        conn.finish(second)
        assert conn.begin("r", ids[:-B], again=second).keys == first.keys[:1]     # other tokens: keyed
        conn.forget_all()
        third = conn.begin("r", ids, again=second)
        assert third.keys is not first.keys and third.keys[0] != first.keys[0] and third.hit.tokens == 0


def test_looking_again_finds_pages_stored_since_on_the_same_keys_until_they_no_longer_hold(tmp_path):
    ids = tokens(2 * B + 1, 22)
    with TieredCache(LAYOUT, disk_config(tmp_path)) as cache:
        conn = Connector(cache)
        waiting = conn.begin("r", ids, salt="tenant")
        keys = waiting.keys
        assert waiting.hit.tokens == 0
        writer = conn.begin("w", ids, salt="tenant")
        conn.offer_block(writer, 0, {0: page(0, 1)})
        conn.offer_block(writer, 1, {0: page(0, 2)})
        conn.offer_state(writer, 2 * B, {1: page(1, 3)})
        conn.finish(writer)
        waiting.retention = dataclasses.replace(waiting.retention, align=0)   # as an engine's stop may
        assert conn.look_again(waiting, salt="tenant")
        assert waiting.keys is keys and waiting.hit.tokens == 2 * B
        assert waiting.retention is conn.retention                  # the one in force, as begin takes
        assert not conn.look_again(waiting, salt="other tenant")     # keyed for another salt
        assert not conn.look_again(waiting, salt="tenant", extra=b"adapter")
        conn.forget_all()
        assert not conn.look_again(waiting, salt="tenant")           # a reset: keys no longer hold
        conn.finish(waiting)


def _eager_hit(cache, conn, ids):
    """The hit rule over every key located in every tier: what the lazy lookup must equal."""
    from hybridkv.core.keys import block_hashes
    from hybridkv.core.retention import compute_hit

    keys = block_hashes(ids, B)
    cap = (len(ids) - 1) // B
    where = {g.id: cache.lookup(g.id, keys[:cap]) for g in conn.groups}
    return compute_hit(conn.groups, len(ids), B, lambda gid, b: where[gid][b] is not None)


def test_state_keys_reach_the_disk_only_when_ram_lacks_them(tmp_path):
    """A prompt wholly in RAM asks the filesystem tier nothing (not one stat per state block);
    after a restart the deepest state is found on disk with a handful of lookups."""
    from hybridkv.tiers.filesystem import FilesystemTier

    ids = tokens(40 * B + 5, 3)
    config = CacheConfig(block_tokens=B, ram_bytes=8 * 1024**2, ram_dir=str(tmp_path), reference_tokens=64 * B)
    fs = FilesystemTier(tmp_path / "s", LAYOUT, direct=False)
    with TieredCache(LAYOUT, config, secondaries=[fs]) as cache:
        conn = Connector(cache)
        req = conn.begin("fill", ids)
        for b in range(40):
            conn.offer_block(req, b, {0: page(0, b)})
        conn.offer_state(req, 40 * B, {1: page(1, 40)})
        conn.finish(req)
        before = fs.stats["disk_lookups"]
        req = conn.begin("again", ids)
        assert req.hit_tokens == 40 * B and fs.stats["disk_lookups"] == before
        conn.finish(req)
    fs.close()
    fs = FilesystemTier(tmp_path / "s", LAYOUT, direct=False)    # a new process: RAM empty
    assert fs.wait_scanned(30)          # until then a key the index lacks costs a stat
    with TieredCache(LAYOUT, config, secondaries=[fs]) as cache:
        conn = Connector(cache)
        req = conn.begin("restart", ids)
        assert req.hit_tokens == 40 * B and req.where[1][39] == "fs"
        assert fs.stats["disk_lookups"] < StateLookup.FIRST_BATCH
        assert np.array_equal(conn.load(req)[1][0], page(1, 40))
        conn.finish(req)
    fs.close()




@pytest.mark.parametrize("seed", range(24))
def test_lazy_state_lookup_finds_the_hit_an_eager_one_finds(tmp_path, seed):
    """Random pages in RAM, only on disk or nowhere, states at random boundaries: same hit."""
    from hybridkv.tiers.filesystem import FilesystemTier

    rng = np.random.default_rng(seed)
    n_blocks = int(rng.integers(2, 60))
    ids = tokens(n_blocks * B + 1, 100 + seed)
    config = CacheConfig(block_tokens=B, ram_bytes=8 * 1024**2, ram_dir=str(tmp_path), reference_tokens=64 * B)
    fs = FilesystemTier(tmp_path / "s", LAYOUT, direct=False)
    with TieredCache(LAYOUT, config, secondaries=[fs]) as cache:
        conn = Connector(cache)
        keys = conn.begin("keys", ids).keys
        for b in range(n_blocks):
            for gid, odds in ((0, [0.45, 0.5, 0.05]), (1, [0.1, 0.2, 0.7])):
                where = rng.choice(["ram", "fs", "none"], p=odds)
                if where == "ram":                             # (written through to disk too)
                    assert store_pages(cache, {gid: [(keys[b], page(gid, b))]})
                elif where == "fs":
                    assert fs.write(gid, keys[b], page(gid, b))
        cache.poll()
        expected = _eager_hit(cache, conn, ids)
        assert conn.begin("lazy", ids).hit == expected
    fs.close()


def _serve(conn, rid, prompt):
    """One request the way an engine runs it: look up, load, offer what the connector wants."""
    req = conn.begin(rid, prompt)
    if req.hit_tokens:
        assert conn.load(req) is not None
    for boundary in range(req.hit_tokens + B, len(prompt) + 1, B):
        if conn.wants_block(req, boundary // B - 1):
            conn.offer_block(req, boundary // B - 1, {0: page(0, boundary)})
        if conn.wants_state(req, boundary):
            conn.offer_state(req, boundary, {1: page(1, boundary)})
    conn.finish(req)
    return req


@pytest.mark.parametrize("chunk, learned", [(4 * B, 4 * B), (B, B)])
def test_the_connector_learns_where_prompts_diverge(tmp_path, chunk, learned):
    """Follow-ups that leave a shared document at multiples of ``chunk`` tokens: after enough
    of them the prompt's own state moves to the deepest multiple (and the tail states go);
    divergences on any block keep the replay boundary and the tail."""
    rng = np.random.default_rng(chunk)
    document = tokens(40 * B, 0)
    with TieredCache(LAYOUT, CacheConfig(block_tokens=B, ram_bytes=64 * 1024**2, ram_dir=str(tmp_path),
                                         spare_states=False)) as cache:
        conn = Connector(cache)
        assert conn.retention.tail == 1 and conn.stats["state_align_tokens"] == B
        for i in range(80):
            shared = chunk * int(rng.integers(1, 40 * B // chunk))
            _serve(conn, f"r{i}", document[:shared] + tokens(int(rng.integers(B + 1, 3 * B)), 100 + i))
        assert conn.stats["state_align_tokens"] == learned
        n = 30 * B + B // 2                         # replay boundary 30 blocks in, 28 on the 4-block grid
        req = conn.begin("probe", tokens(n, 999))
        kept = [b for b in range(B, n, B) if conn.wants_state(req, b)]
        conn.finish(req)
    assert kept == ([(n - 1) // B * B // learned * learned] if learned > B
                    else [(n - 1) // B * B - B, (n - 1) // B * B])


def test_a_given_state_alignment_is_not_relearned(tmp_path):
    config = CacheConfig(block_tokens=B, ram_bytes=1024**2, ram_dir=str(tmp_path), state_align=2 * B)
    with TieredCache(LAYOUT, config) as cache:
        conn = Connector(cache)
        assert conn.alignment is None and conn.retention.align == 2 * B
        for i in range(70):
            _serve(conn, f"r{i}", tokens(3 * B + 1, 7)[: B * (1 + i % 3) + 1] + tokens(2 * B, 200 + i))
        assert conn.retention.align == 2 * B and conn.stats["state_align_tokens"] == 2 * B


def test_reference_learner_looks_early_then_less_often_and_only_asks_when_far_off():
    learner, first = ReferenceLearner(B), ReferenceLearner.FIRST
    asked = [learner.observe(f"r{i}", 10 * B, 100 * B) for i in range(first)]
    assert asked[:-1] == [None] * (first - 1) and asked[-1] == 10 * B
    assert learner.observe("r0", 10 * B, 100 * B) == 10 * B       # still wanted, r0 not counted again
    assert learner.prompts == first
    learner.replanned()                               # next look after as many requests again
    assert learner.wanted is None and learner.next_look == 2 * first
    near = [learner.observe(f"s{i}", 12 * B, 10 * B) for i in range(first)]
    assert near == [None] * first                     # mean 11 blocks vs 10 planned: close enough
    assert learner.next_look == 4 * first


@pytest.mark.parametrize("split", ["static", "shared"])
def test_ram_is_replanned_for_the_traffic_when_no_reference_was_given(tmp_path, split):
    """Unset, RAM is split for the model's longest prompts; once the traffic shows much
    shorter ones, the cache re-plans for them (more state slots), and a hit works after.
    Split statically, RAM's pages went with the old regions; over one arena they stay, and
    so do the learned insertion's shadows (at the new plan's sizes)."""
    ram_only = CacheConfig(block_tokens=B, ram_bytes=1024**2, ram_dir=str(tmp_path), ram_split=split)
    with TieredCache(LAYOUT, ram_only) as cache:
        conn = Connector(cache)
        assert cache.plan.reference_tokens == LAYOUT.max_model_len
        before = cache.plan.slots_per_group()[1]
        prompt = tokens(4 * B + 1, 1)
        for i in range(ReferenceLearner.FIRST + 200):  # the new regions are made meanwhile
            _serve(conn, f"r{i}", prompt[: 4 * B] + tokens(B + 1, 100 + i))
            if conn.stats["replans"]:
                break
            time.sleep(0.01)
        assert conn.stats["replans"] == 1 and cache.plan.reference_tokens == 5 * B
        assert conn.stats["reference_tokens"] == 5 * B and i + 1 >= ReferenceLearner.FIRST
        assert cache.plan.slots_per_group()[1] > before
        shadow = conn.insertion.shadows[0]
        assert (shadow.block_slots, shadow.state_slots) == (cache.plan.token_slots, cache.plan.slots_per_group()[1])
        assert (len(shadow.blocks) > 0) == (split == "shared")
        req = conn.begin("kept", prompt)               # the prefix every request shared
        assert req.hit_tokens == (4 * B if split == "shared" else 0)
        conn.finish(req)
        _serve(conn, "again", prompt)
        req = conn.begin("hit", prompt)               # served from RAM's new regions
        assert req.hit_tokens == 4 * B
        conn.finish(req)
    config = CacheConfig(block_tokens=B, ram_bytes=1024**2, ram_dir=str(tmp_path), reference_tokens=2 * B)
    with TieredCache(LAYOUT, config) as cache:
        conn = Connector(cache)
        for i in range(ReferenceLearner.FIRST):
            _serve(conn, f"r{i}", tokens(5 * B + 1, 100 + i))
        assert conn.reference is None and conn.stats["replans"] == 0 and cache.plan.reference_tokens == 2 * B


def test_a_replan_that_cannot_be_made_stops_the_learning_with_a_warning(tmp_path, caplog):
    ram = tmp_path / "ram"
    ram.mkdir()
    config = CacheConfig(block_tokens=B, ram_bytes=1024**2, ram_dir=str(ram), ram_split="static")
    with TieredCache(LAYOUT, config) as cache:
        conn = Connector(cache)
        shutil.rmtree(ram)
        for i in range(ReferenceLearner.FIRST + 200):
            _serve(conn, f"r{i}", tokens(3 * B + 1, i))
            if conn.reference is None:
                break
            time.sleep(0.01)
        assert conn.reference is None and conn.stats["replans"] == 0
        assert any("RAM stays split for 4096-token prompts" in r.getMessage() for r in caplog.records)


def test_a_request_the_engine_will_ask_about_again_teaches_the_insertion_nothing(cache):
    """vLLM finishes a request it looks up afresh (allocated or preempted) and begins it again:
    only its last, real run may enter the shadows."""
    conn = Connector(cache)
    prompt = tokens(4 * B + 1, 7)
    conn.finish(conn.begin("again", prompt), done=False)
    assert not conn.insertion.shadows[0].blocks
    conn.finish(conn.begin("again", prompt))
    assert len(conn.insertion.shadows[0].blocks) == 4


def test_the_learned_choices_keep_their_scores_across_a_reset_with_empty_shadows(cache):
    """The insertion and the periodic states: a reset empties RAM, not the traffic."""
    conn = Connector(cache)
    conn.finish(conn.begin("r", tokens(4 * B + 1, 7)))
    conn.insertion.score, conn.periodic.score = 123.0, 5.0
    conn.forget_all()
    assert conn.insertion.score == 123.0 and not conn.insertion.shadows[0].blocks
    assert conn.periodic.score == 5.0 and not conn.periodic.shadows[0].blocks
    assert conn.stats["insertion_cold"] == 1
    assert conn.begin("r2", tokens(4 * B + 1, 8)).retention.interval == 0


@pytest.mark.parametrize("insertion, used", [("adaptive", "warm"), ("cold", "cold"), ("warm", "warm")])
def test_under_arc_the_shadows_of_lru_do_not_decide(tmp_path, insertion, used):
    config = CacheConfig(block_tokens=B, ram_bytes=1024**2, ram_dir=str(tmp_path), eviction="arc",
                         insertion=insertion)
    with TieredCache(LAYOUT, config) as cache:
        assert Connector(cache).insertion.mode == used


def test_retention_auto_pauses_periodic_states_while_ram_restores_more_without_them(cache):
    conn = Connector(cache)
    interval = conn.periodic.interval
    prompt = tokens(interval + 2 * B + 1, 3)
    req = conn.begin("with", prompt)
    assert req.retention.keeps(interval, req.n_tokens) and conn.stats["periodic_states"] == 1
    conn.finish(req)
    conn.periodic.score = 1.0            # the shadow without them restored more lately
    req = conn.begin("without", prompt)
    assert not req.retention.keeps(interval, req.n_tokens) and req.retention.interval == 0
    assert conn.is_spare(req, PageKind.STATE, interval) and conn.stats["periodic_states"] == 0
    conn.finish(req)
    conn.periodic.score = -1.0
    assert conn.begin("again", prompt).retention.interval == interval


@pytest.mark.parametrize("split, shadow", [("shared", SharedShadowCache), ("static", ShadowCache)])
def test_the_periodic_choice_replays_ram_as_it_is_split(split, shadow):
    config = CacheConfig(block_tokens=B, ram_bytes=4 * 1024**2, reference_tokens=8 * B, ram_split=split)
    with TieredCache(LAYOUT, config, secondaries=[], pageless=True) as cache:
        conn = Connector(cache)
        choice = conn.periodic
        assert all(type(s) is shadow for s in choice.shadows)
        first = choice.shadows[0]
        if split == "shared":
            assert first.budget == cache.shared_ram_bytes > 0
            assert (first.block_bytes, first.state_bytes) == (LAYOUT.group(0).page_bytes, LAYOUT.group(1).page_bytes)
        else:
            assert cache.shared_ram_bytes is None
            assert (first.block_slots, first.state_slots) == (cache.plan.token_slots, cache.plan.slots_per_group()[1])
        prompt = tokens(4 * B + 1, 5)
        conn.finish(conn.begin("r", prompt))
        keys = conn.begin("again", prompt).keys
        assert all(s.has_block(k) for s in choice.shadows for k in keys[:4])     # finish taught both
        assert all(s.has_state(keys[3]) for s in choice.shadows)


@pytest.mark.parametrize("settings", [{"retention": 0}, {"retention": 64 * B}, {"retention": "dense"},
                                      {"eviction": "arc"}])
def test_periodic_states_are_learned_only_for_retention_auto_under_lru(settings):
    config = CacheConfig(block_tokens=B, ram_bytes=1024**2, reference_tokens=8 * B, **settings)
    with TieredCache(LAYOUT, config, secondaries=[], pageless=True) as cache:
        conn = Connector(cache)
        assert conn.periodic is None
        assert conn.retention.interval == config.retention_tokens(B)


def test_no_periodic_choice_for_a_retention_of_the_callers_or_a_model_without_states():
    config = CacheConfig(block_tokens=B, ram_bytes=1024**2, reference_tokens=8 * B)
    with TieredCache(LAYOUT, config, secondaries=[], pageless=True) as cache:
        assert Connector(cache, Retention(B, 0)).periodic is None
    attention_only = dataclasses.replace(LAYOUT, groups=LAYOUT.groups[:1])
    with TieredCache(attention_only, config, secondaries=[], pageless=True) as cache:
        conn = Connector(cache)
        conn.finish(conn.begin("r", tokens(4 * B + 1, 1)))
        assert conn.periodic is None and "periodic_states" not in conn.stats


def test_a_request_begun_before_a_reset_teaches_the_new_periodic_choice_nothing(cache):
    conn = Connector(cache)
    req = conn.begin("r", tokens(4 * B + 1, 2))
    conn.forget_all()
    conn.finish(req)
    assert not conn.periodic.shadows[0].blocks and not conn.periodic.shadows[1].blocks


def test_a_request_storing_less_than_the_shadows_restore_finishes(cache):
    """An engine may cap what a request stores below what it hit (``max_stored_tokens``): the
    shadows take what it stored."""
    conn = Connector(cache)
    prompt = tokens(4 * B + 1, 4)
    conn.finish(conn.begin("first", prompt))
    req = conn.begin("capped", prompt, max_stored_tokens=2 * B)
    assert req.periodic[1] == (4, 4) and req.ticket.warm_hit == 4
    conn.finish(req)
    assert all(s.has_state(req.keys[3]) for s in conn.periodic.shadows)
