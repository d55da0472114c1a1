"""Durable page offers, driven directly through the engine-neutral connector."""

import logging

import numpy as np
import pytest

from hybridkv.cache import TieredCache
from hybridkv.config import CacheConfig
from hybridkv.connector import Connector

from helpers.tier_worker import LAYOUT, page

B = LAYOUT.block_tokens


@pytest.fixture
def cache():
    # 8 token slots and 2 state slots (reference 4 blocks: one request + one junction)
    budget = 8 * LAYOUT.group(0).page_bytes + 2 * LAYOUT.group(1).page_bytes
    with TieredCache(LAYOUT, CacheConfig(block_tokens=B, ram_bytes=budget, reference_tokens=8 * B)) as c:
        assert c.plan.slots_per_group() == {0: 8, 1: 2}
        yield c


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
    cache.acquire(pins)                                     # both state slots pinned
    req = conn.begin("r", tokens(2 * B + 1, 9))
    conn.offer_state(req, 2 * B, {1: page(1, 9)})
    assert list(req.pending) == [("state", 2 * B)] and req.stored["state"] == 0
    conn.step(req)
    assert list(req.pending) == [("state", 2 * B)]          # still pinned: still pending
    cache.release(pins)
    conn.step(req)                                          # a later step succeeds
    assert not req.pending and req.stored["state"] == 1
    views = cache.acquire({1: [req.keys[1]]})
    assert np.array_equal(views[1][0], page(1, 9))


def test_reoffer_supersedes_the_pending_offer(cache):
    conn = Connector(cache)
    holders = fill_states(cache, conn, (1, 2))
    pins = {1: [r.keys[1] for r in holders]}
    cache.acquire(pins)
    req = conn.begin("r", tokens(2 * B + 1, 9))
    conn.offer_state(req, 2 * B, {1: page(1, 7)})
    conn.offer_state(req, 2 * B, {1: page(1, 8)})           # same boundary, newer source
    assert len(req.pending) == 1 and conn.stats["offers_pending"] == 1
    cache.release(pins)
    conn.step(req)
    assert conn.stats["offers_pending"] == 0
    assert np.array_equal(cache.acquire({1: [req.keys[1]]})[1][0], page(1, 8))


def test_offers_pending_at_finish_are_dropped_with_a_warning(cache, caplog):
    conn = Connector(cache)
    holders = fill_states(cache, conn, (1, 2))
    cache.acquire({1: [r.keys[1] for r in holders]})
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
    req = conn.begin("r", tokens(5 * B + 3, 4), max_stored_tokens=3 * B)
    assert [b for b in range(0, 6 * B, B) if conn.wants_state(req, b)] == []   # replay 5B is over the cap
    req = conn.begin("r2", tokens(5 * B + 3, 4))
    assert [b for b in range(0, 6 * B, B) if conn.wants_state(req, b)] == [5 * B]


def test_misses_are_counted_per_tier(tmp_path):
    from hybridkv.tiers.filesystem import FilesystemTier
    from hybridkv.tools.metrics import to_prometheus

    config = CacheConfig(block_tokens=B, ram_bytes=1024**2, ram_dir=str(tmp_path), store=str(tmp_path / "s"))
    on_disk = FilesystemTier(tmp_path / "s", LAYOUT)
    assert on_disk.write(0, b"d" * 16, page(0, 1))
    on_disk.close()
    with TieredCache(LAYOUT, config) as cache:
        cache.store({0: [(b"r" * 16, page(0, 2))]})
        assert cache.locate(0, [b"r" * 16, b"d" * 16, b"n" * 16]) == ["ram", "fs", None]
        stats = cache.stats()
    assert stats["tiers"]["ram"]["misses"] == 2 and stats["tiers"]["fs"]["misses"] == 1
    assert 'hybridkv_tier_misses_total{tier="fs"} 1' in to_prometheus(stats)
