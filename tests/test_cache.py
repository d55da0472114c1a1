"""TieredCache: write-through, reservations by another process, promotion from secondary tiers."""

import shutil
import threading
import time

import numpy as np
import pytest

from hybridkv.cache import TieredCache, store_pages
from hybridkv.config import CacheConfig
from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import layout_from_dict
from hybridkv.ram import regions
from hybridkv.ram.regions import POPULATOR, SharedRegion
from hybridkv.tiers import filesystem
from hybridkv.tiers.filesystem import FilesystemTier

from helpers.smaps import mapped_bytes
from helpers.tier_worker import LAYOUT, flip_payload_byte, key, load_now, page


def test_write_through_pins_until_written_then_promotes_after_restart(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    with TieredCache(LAYOUT, config) as cache:
        assert store_pages(cache, {0: [(key(1), page(0, 1))], 1: [(key(1), page(1, 1))]})
        assert cache.pools.pool(1).refs_of(key(1)) == 1     # pinned until poll sees the write land
        cache.drain()
        assert cache.pools.pool(1).refs_of(key(1)) == 0
    with TieredCache(LAYOUT, config) as cache:
        assert cache.lookup(1, [key(1), key(2)]) == ["fs", None]
        load, views = load_now(cache, {0: [key(1)], 1: [key(1)]})
        assert np.array_equal(views[1][0], page(1, 1))
        cache.release(load)
        assert cache.lookup(1, [key(1)]) == ["ram"]
        assert cache.stats()["tiers"]["fs"]["hits"] == 2


def test_wait_written_lands_held_writes_from_another_thread_without_touching_the_pins(tmp_path):
    """The vLLM stop path: a thread waits for the writes while the engine thread owns the cache."""
    config = CacheConfig(block_tokens=16, ram_bytes=8 * 1024**2, store=str(tmp_path))
    with TieredCache(LAYOUT, config) as cache:
        pages = {0: [(key(i), page(0, i)) for i in range(3)], 1: [(key(i), page(1, i)) for i in range(3)]}
        assert store_pages(cache, pages)
        landed = []
        waiter = threading.Thread(target=lambda: landed.append(cache.wait_written(10)))
        waiter.start()
        waiter.join()
        assert landed == [True]
        assert cache.pools.pool(1).refs_of(key(2)) == 1    # still pinned: only poll unpins
        other = FilesystemTier(tmp_path, LAYOUT)            # another process's view of the disk
        assert other.wait_ready(30)
        try:
            assert other.contains_many(1, [key(i) for i in range(3)]) == [True] * 3
        finally:
            other.close()
        cache.drain()
        assert cache.pools.pool(1).refs_of(key(2)) == 0


def test_reserved_slots_filled_by_another_process_are_served_only_after_commit(tmp_path):
    """The vLLM worker's path: reserve, fill the shared slot from another process, commit."""
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path / "kv"))
    with TieredCache(LAYOUT, config) as cache:
        plans = cache.prepare_store({1: [key(7)]})
        assert cache.pools.pool(1).lookup(key(7)).value == "hit_pending"
        assert cache.prepare_load({1: [key(7)]}) is None           # never served half-written
        region = cache.regions[1]
        attached = SharedRegion.attach(region.path, region.slots, region.page_bytes)
        attached.write(plans[1].slots[0], page(1, 7))
        attached.close()
        cache.complete_store(plans)
        again = cache.prepare_store({1: [key(7)]})
        assert again is not None and not again[1].keys          # present now: nothing to reserve
        load, views = load_now(cache, {1: [key(7)]})
        assert np.array_equal(views[1][0], page(1, 7))
        cache.release(load)
        cache.drain()
    with TieredCache(LAYOUT, config) as cache:                   # written through to disk
        assert cache.lookup(1, [key(7)]) == ["fs"]


def test_abandoned_reservation_leaves_no_page(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2)
    with TieredCache(LAYOUT, config) as cache:
        plans = cache.prepare_store({0: [key(8)], 1: [key(8)]})
        cache.complete_store(plans, ok=False)
        assert cache.lookup(0, [key(8)]) == [None] and cache.lookup(1, [key(8)]) == [None]
        assert store_pages(cache, {0: [(key(8), page(0, 8))], 1: [(key(8), page(1, 8))]})


def test_corrupt_secondary_page_fails_acquire_and_is_not_served(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    with TieredCache(LAYOUT, config) as cache:
        store_pages(cache, {1: [(key(4), page(1, 4))]})
    flip_payload_byte(tmp_path, 1, key(4))
    with TieredCache(LAYOUT, config) as cache:
        assert load_now(cache, {1: [key(4)]}) == (None, None)
        assert cache.lookup(1, [key(4)]) == [None]
        assert cache.pools.pool(1).lookup(key(4)).value == "miss"


@pytest.mark.parametrize("below_ram", [True, False], ids=["with-disk", "ram-only"])
def test_each_step_maps_ahead_the_slots_the_pools_handed_out(tmp_path, monkeypatch, below_ram):
    """Promotions read into the slots a pool hands out next; their pages are mapped by then.
    With no tier below RAM this process never writes a slot (the engine's copies do, in the
    process that copies) and maps nothing."""
    window, page_bytes = 1 << 20, 65536
    monkeypatch.setattr(regions, "MAP_AHEAD_BYTES", window)
    layout = layout_from_dict({"model": "ahead", "block_tokens": 16, "max_model_len": 4096,
                               "groups": [{"id": 0, "kind": "attention", "page_bytes": page_bytes}]})
    config = CacheConfig(block_tokens=16, ram_bytes=5 * window, ram_dir=str(tmp_path),
                         store=str(tmp_path / "store") if below_ram else None)
    with TieredCache(layout, config) as cache:
        region = cache.regions[0]
        cache.poll()
        assert POPULATOR.wait(region, 60)
        assert mapped_bytes(region.path) == 0       # nothing in use, nothing mapped
        n = window // page_bytes + 8
        plans = cache.prepare_store({0: [key(i) for i in range(n)]})    # reserved, not written
        cache.poll()
        assert POPULATOR.wait(region, 60)
        assert mapped_bytes(region.path) == (n * page_bytes + 2 * window if below_ram else 0)
        cache.complete_store(plans, ok=False)


def replan_when_ready(cache, reference_tokens) -> bool:
    """Ask until the new regions are made and RAM is idle (at most 10 s)."""
    for _ in range(1000):
        if cache.replan(reference_tokens):
            return True
        time.sleep(0.01)
    return False


def test_replan_waits_until_nothing_in_ram_is_in_use_then_swaps_the_regions(tmp_path):
    """Split statically: new pools and regions for another prompt length, made off the
    caller's thread; the old files go, the disk keeps what was written through, and nothing
    changes while a page is pinned or being written."""
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, ram_dir=str(tmp_path), store=str(tmp_path / "s"),
                         ram_split="static")
    with TieredCache(LAYOUT, config) as cache:
        assert store_pages(cache, {0: [(key(1), page(0, 1))], 1: [(key(1), page(1, 1))]})
        assert not cache.replan(64)                     # starts making the regions; pages pinned
        time.sleep(0.5)
        assert not cache.replan(64)                     # the write-through still pins the pages
        cache.drain()
        load, _ = load_now(cache, {0: [key(1)], 1: [key(1)]})
        assert not cache.replan(64)                     # a load pins them
        cache.release(load)
        old = {gid: r.path for gid, r in cache.regions.items()}
        states_before = cache.plan.slots_per_group()[1]
        assert replan_when_ready(cache, 64)
        assert cache.plan.reference_tokens == 64 and cache.plan.slots_per_group()[1] > states_before
        assert all(not path.exists() for path in old.values())
        assert all(r.path.exists() and r.path != old[gid] for gid, r in cache.regions.items())
        assert cache.lookup(1, [key(1)]) == ["fs"]      # RAM dropped, the disk copy serves
        load, views = load_now(cache, {0: [key(1)], 1: [key(1)]})
        assert np.array_equal(views[1][0], page(1, 1))
        cache.release(load)


def test_replan_over_one_arena_keeps_every_page_and_region(tmp_path):
    """RAM's groups share one arena whose split follows the traffic: a re-plan changes the
    plan only, at once, even while a page is pinned, and every page still loads."""
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, ram_dir=str(tmp_path))
    with TieredCache(LAYOUT, config) as cache:
        assert cache.shared_ram_bytes is not None
        assert store_pages(cache, {0: [(key(1), page(0, 1))], 1: [(key(1), page(1, 1))]})
        regions = dict(cache.regions)
        load, _ = load_now(cache, {0: [key(1)]})
        states_before = cache.plan.slots_per_group()[1]
        assert cache.replan(64)
        assert cache.plan.reference_tokens == 64 and cache.plan.slots_per_group()[1] > states_before
        assert cache.regions == regions and all(r.path.exists() for r in regions.values())
        cache.release(load)
        load, views = load_now(cache, {0: [key(1)], 1: [key(1)]})
        assert np.array_equal(views[0][0], page(0, 1)) and np.array_equal(views[1][0], page(1, 1))
        cache.release(load)


def test_a_replan_whose_regions_cannot_be_made_changes_nothing(tmp_path):
    ram = tmp_path / "ram"
    ram.mkdir()
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, ram_dir=str(ram), ram_split="static")
    with TieredCache(LAYOUT, config) as cache:
        plan = cache.plan
        shutil.rmtree(ram)                              # the new regions have nowhere to go
        with pytest.raises(HybridKVError, match="cannot re-plan RAM: ram_dir .* does not exist"):
            replan_when_ready(cache, 64)
        assert cache.plan is plan                       # the old regions still serve
        assert store_pages(cache, {0: [(key(2), page(0, 2))], 1: [(key(2), page(1, 2))]})
        load, views = load_now(cache, {0: [key(2)], 1: [key(2)]})
        assert np.array_equal(views[0][0], page(0, 2))
        cache.release(load)


@pytest.mark.parametrize("split, regions", [("shared", 1), ("static", 2)])
def test_regions_are_removed_at_close(tmp_path, split, regions):
    """One arena the groups share, or a region per group: none is left behind."""
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, ram_dir=str(tmp_path), ram_split=split)
    cache = TieredCache(LAYOUT, config)
    assert len(list(tmp_path.glob("hybridkv-*.lease"))) == regions
    cache.close()
    assert not list(tmp_path.iterdir())


def test_promotion_never_evicts_resident_pages_of_the_same_request(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path), tail_states=0)
    with TieredCache(LAYOUT, config) as cache:
        store_pages(cache, {0: [(key(i), page(0, i)) for i in range(3)]})
        cache.drain()
    small = LAYOUT.group(0).page_bytes * 3 + LAYOUT.group(1).page_bytes * 4
    with TieredCache(LAYOUT, config.replace(ram_bytes=small, reference_tokens=32)) as cache:
        assert cache.plan.token_slots == 3
        load, _ = load_now(cache, {0: [key(0)]})        # key 0 promoted, then released
        cache.release(load)
        store_pages(cache, {0: [(key(7), page(0, 7)), (key(8), page(0, 8))]})   # RAM now full
        cache.drain()
        _, views = load_now(cache, {0: [key(0), key(1), key(2)]})
        assert views is not None
        for i in range(3):
            assert np.array_equal(views[0][i], page(0, i))


def test_promotion_waits_for_write_through_pins_instead_of_missing(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    with TieredCache(LAYOUT, config) as cache:
        store_pages(cache, {0: [(key(i), page(0, i)) for i in range(3)]})
    small = LAYOUT.group(0).page_bytes * 3 + LAYOUT.group(1).page_bytes * 4
    with TieredCache(LAYOUT, config.replace(ram_bytes=small, reference_tokens=32)) as cache:
        store_pages(cache, {0: [(key(i), page(0, i)) for i in (7, 8, 9)]})   # RAM full, pinned until written
        assert all(cache.pools.pool(0).refs_of(key(i)) == 1 for i in (7, 8, 9))
        _, views = load_now(cache, {0: [key(0), key(1), key(2)]})
        assert views is not None
        assert all(np.array_equal(views[0][i], page(0, i)) for i in range(3))


def test_a_store_refused_for_want_of_ram_releases_the_held_write_through(tmp_path, monkeypatch):
    monkeypatch.setattr(filesystem.writes, "PACK_LINGER_S", 600)      # only a flush writes held pages
    small = LAYOUT.group(0).page_bytes * 3 + LAYOUT.group(1).page_bytes * 4
    config = CacheConfig(block_tokens=16, ram_bytes=small, reference_tokens=32, store=str(tmp_path),
                         tail_states=0)
    with TieredCache(LAYOUT, config) as cache:
        assert store_pages(cache, {0: [(key(i), page(0, i)) for i in (1, 2, 3)]})
        assert not store_pages(cache, {0: [(key(4), page(0, 4))]})     # every slot pinned by write-through
        deadline = time.monotonic() + 30    # the refusal flushed them: they land with no other flush
        while cache.stats()["pending_writes"] and time.monotonic() < deadline:
            cache.poll()                        # (poll unpins landed writes; it flushes nothing)
            time.sleep(0.01)
        assert cache.stats()["pending_writes"] == 0
        assert store_pages(cache, {0: [(key(4), page(0, 4))]})


def _stored_on_disk(tmp_path, config, n):
    """Pages 0..n-1 of both groups on disk, none in the RAM of the cache opened next."""
    with TieredCache(LAYOUT, config) as cache:
        for i in range(n):          # one at a time: RAM has few state slots
            assert store_pages(cache, {g: [(key(i), page(g, i))] for g in (0, 1)})
            cache.drain()


def test_a_started_promotion_is_shared_by_every_request_wanting_its_pages(tmp_path):
    """vLLM's path: start the reads, answer at once, collect them a step later. A second
    request wanting the same pages meanwhile waits on the same reads instead of missing."""
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    _stored_on_disk(tmp_path, config, 3)
    with TieredCache(LAYOUT, config) as cache:
        store_pages(cache, {0: [(key(9), page(0, 9))]})
        first = cache.prepare_load({0: [key(9), key(0), key(1)], 1: [key(1)]}, "a")
        assert cache.pools.pool(0).lookup(key(0)).value == "hit_pending"   # not served half-read
        assert cache.pools.pool(0).refs_of(key(9)) == 2        # resident: pinned now (+ its write)
        second = cache.prepare_load({0: [key(0), key(1), key(2)]}, "b")
        assert second is not None and len(second.waiting) == 2      # joined + its own read
        assert cache.stats()["promotions_in_flight"] == 2
        views = cache.complete_load(second)
        assert all(np.array_equal(v, page(0, i)) for i, v in enumerate(views[0]))
        assert first.ready()
        views = cache.complete_load(first)
        assert np.array_equal(views[0][1], page(0, 0)) and np.array_equal(views[1][0], page(1, 1))
        assert cache.pools.pool(0).refs_of(key(0)) == 2          # pinned once for each request
        assert cache.counters["fs"].hits == 4                    # each page read once
        cache.release(first)
        cache.release(second)
        cache.drain()
        assert all(cache.pools.pool(0).refs_of(key(i)) == 0 for i in (0, 1, 2, 9))
        assert cache.stats()["promotions_in_flight"] == 0


def test_a_promotion_that_fails_fails_every_waiting_request_and_pins_nothing(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    _stored_on_disk(tmp_path, config, 3)
    flip_payload_byte(tmp_path, 0, key(1))
    with TieredCache(LAYOUT, config) as cache:
        store_pages(cache, {0: [(key(9), page(0, 9))]})
        cache.drain()
        first = cache.prepare_load({0: [key(9), key(0), key(1)]}, "a")
        second = cache.prepare_load({0: [key(1)], 1: [key(2)]}, "b")
        assert cache.complete_load(first) is None
        assert cache.complete_load(second) is None
        pool = cache.pools.pool(0)
        assert pool.refs_of(key(9)) == 0 and pool.refs_of(key(0)) == 0    # unpinned, still served
        assert pool.lookup(key(1)).value == "miss" and cache.lookup(0, [key(1)]) == [None]
        assert cache.pools.pool(1).refs_of(key(2)) == 0
        assert cache.request_finished("a") == 0 and cache.request_finished("b") == 0   # no leak


def test_a_promotion_lands_for_nobody_when_its_request_is_gone(tmp_path):
    """An aborted request: its pages still arrive (the next asker hits RAM), pinned for no one."""
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    _stored_on_disk(tmp_path, config, 2)
    with TieredCache(LAYOUT, config) as cache:
        cache.request_started("a")
        acquisition = cache.prepare_load({0: [key(0), key(1)]}, "a")
        cache.release(acquisition)
        assert cache.request_finished("a") == 0
        cache.drain()
        assert cache.lookup(0, [key(0), key(1)]) == ["ram", "ram"]
        assert cache.pools.pool(0).refs_of(key(0)) == 0
        later = cache.prepare_load({0: [key(0)]}, "b")
        assert not later.waiting and later.ready()


def test_a_read_that_raises_is_a_miss_not_an_exception(tmp_path, monkeypatch, caplog):
    """What reaches vLLM's scheduler from a promotion is a failed load, never a traceback."""
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    _stored_on_disk(tmp_path, config, 2)

    def broken(self, pack, pages):
        raise RuntimeError("injected: the read thread broke")

    monkeypatch.setattr(FilesystemTier, "read_run", broken)
    with TieredCache(LAYOUT, config) as cache:
        acquisition = cache.prepare_load({0: [key(0), key(1)]}, "a")
        assert cache.complete_load(acquisition) is None
        assert cache.pools.pool(0).lookup(key(0)).value == "miss"      # the slots are free again
        assert cache.stats()["promotions_in_flight"] == 0
    assert "2 reads into RAM raised" in caplog.text and "injected" in caplog.text


def test_pages_located_by_the_caller_are_read_from_there_and_a_stale_answer_costs_nothing(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    _stored_on_disk(tmp_path, config, 2)
    with TieredCache(LAYOUT, config) as cache:
        where = cache.lookup(0, [key(0), key(1), key(7)])
        assert where == ["fs", "fs", None]
        stale = {0: ["ram", "fs"]}                  # key 0 left RAM since: looked up again
        views = cache.complete_load(cache.prepare_load({0: [key(0), key(1)]}, "a", stale))
        assert np.array_equal(views[0][0], page(0, 0)) and np.array_equal(views[0][1], page(0, 1))
        wrong = cache.prepare_load({0: [key(7)]}, "b", {0: ["fs"]})      # not there after all
        assert cache.complete_load(wrong) is None
        assert cache.pools.pool(0).lookup(key(7)).value == "miss"
        assert cache.request_finished("b") == 0


def test_prefetched_pages_are_read_once_waited_for_by_a_load_and_published_if_none_waits(tmp_path):
    """What lets an engine start a prompt's disk reads while it is still keying it: only
    pages RAM lacks and a tier holds are read, once; a load wanting them waits for those
    reads; the rest reach RAM unpinned."""
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    _stored_on_disk(tmp_path, config, 4)
    with TieredCache(LAYOUT, config) as cache:
        store_pages(cache, {0: [(key(9), page(0, 9))]})
        keys = [key(9), key(0), key(1), key(2), key(7)]
        where = cache.lookup(0, keys)
        assert where == ["ram", "fs", "fs", "fs", None]
        assert cache.prefetch(0, keys, where) == 3
        assert cache.prefetch(0, keys, cache.lookup(0, keys)) == 0       # in flight: not again
        acquisition = cache.prepare_load({0: [key(0), key(1)]}, "a")
        assert acquisition is not None and not acquisition.pinned   # it waits for the prefetch
        views = cache.complete_load(acquisition)
        assert all(np.array_equal(v, page(0, i)) for i, v in enumerate(views[0]))
        cache.release(acquisition)
        cache.drain()
        pool = cache.pools.pool(0)
        assert pool.lookup(key(2)).value == "hit" and pool.refs_of(key(2)) == 0
        assert cache.secondaries[0].stats["reads"] == 3
        assert cache.request_finished("a") == 0


def test_reads_a_load_joined_stay_its_own_when_making_room_for_its_other_pages_drains(tmp_path):
    """RAM is full and write-throughs are pending, so making room for a load's own reads
    drains, and that settles the prefetch the load joined. Those pages must be pinned for
    the load there, not published unpinned and then evicted for its other pages: 2 joined
    + 7 more pages cannot fit in 8 slots, so the load fails and pins nothing."""
    B = LAYOUT.block_tokens
    budget = 8 * LAYOUT.group(0).page_bytes + 2 * LAYOUT.group(1).page_bytes
    config = CacheConfig(block_tokens=B, ram_bytes=budget, reference_tokens=8 * B, store=str(tmp_path),
                         tail_states=0)
    with TieredCache(LAYOUT, config) as cache:
        assert cache.plan.slots_per_group()[0] == 8
        for i in range(9):
            assert store_pages(cache, {0: [(key(i), page(0, i))]})
            cache.drain()
    with TieredCache(LAYOUT, config) as cache:
        assert cache.prefetch(0, [key(0), key(1)], cache.lookup(0, [key(0), key(1)])) == 2
        for i in range(6):                   # RAM full: 2 being read, 6 held by their writes
            assert store_pages(cache, {0: [(key(20 + i), page(0, 20 + i))]})
        acquisition = cache.prepare_load({0: [key(i) for i in range(9)]}, "a")
        if acquisition is not None:          # it must then serve every page it promised
            views = cache.complete_load(acquisition)
            assert views is not None and all(np.array_equal(v, page(0, i)) for i, v in enumerate(views[0]))
            cache.release(acquisition)
        assert acquisition is None
        assert cache.request_finished("a") == 0
        cache.drain()
        assert all(cache.pools.pool(0).refs_of(key(i)) == 0 for i in (0, 1))
        # a prefetch short of room reads nothing and waits for no write: the load makes room
        for i in range(8):
            assert store_pages(cache, {0: [(key(30 + i), page(0, 30 + i))]})
        assert cache.prefetch(0, [key(2)], ["fs"]) == 0
        assert cache.stats()["pending_writes"] == 8 and cache.stats()["promotions_in_flight"] == 0


def test_arrivals_give_pinned_pages_at_once_then_each_read_as_it_lands_never_a_failed_one(tmp_path, monkeypatch):
    """What lets an engine copy pages while later ones are still being read: a page is
    yielded while another page's read is held back, with the bytes stored; a page that
    does not read back is never yielded, and the load then fails."""
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    _stored_on_disk(tmp_path, config, 4)               # a pack per page: a read per page
    flip_payload_byte(tmp_path, 0, key(3))
    gate = threading.Event()
    read_run = FilesystemTier.read_run

    def held_back(self, pack, pages):
        if any(item[1] == key(2) for _, item in pages):
            assert gate.wait(30)
        return read_run(self, pack, pages)

    monkeypatch.setattr(FilesystemTier, "read_run", held_back)
    with TieredCache(LAYOUT, config) as cache:
        store_pages(cache, {0: [(key(9), page(0, 9))]})
        acquisition = cache.prepare_load({0: [key(9), key(0), key(1), key(2), key(3)], 1: [key(1)]}, "a")
        arrivals = cache.arrivals(acquisition)
        assert next(arrivals)[:2] == (0, [0])            # resident: at once
        seen = {}
        while len(seen) < 3:                             # keys 0 and 1, state 1: key 2 is held back
            group, positions, views = next(arrivals)
            seen.update({(group, p): v.copy() for p, v in zip(positions, views, strict=True)})
        assert sorted(seen) == [(0, 1), (0, 2), (1, 0)] and not acquisition.ready()
        gate.set()
        for group, positions, views in arrivals:
            seen.update({(group, p): v.copy() for p, v in zip(positions, views, strict=True)})
        assert (0, 4) not in seen                        # key 3 is corrupt
        assert np.array_equal(seen[(0, 3)], page(0, 2)) and np.array_equal(seen[(1, 0)], page(1, 1))
        assert all(np.array_equal(seen[(0, i + 1)], page(0, i)) for i in range(3))
        assert cache.complete_load(acquisition) is None
        assert cache.request_finished("a") == 0


def test_a_write_that_raises_never_reaches_the_drain_that_waits_for_it(tmp_path, monkeypatch, caplog):
    """drain runs inside engines' lookups when RAM is short: a broken write is logged there,
    and the page is only not stored below RAM."""
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))

    def broken(self, pages):
        raise RuntimeError("injected: the write thread broke")

    monkeypatch.setattr(FilesystemTier, "write_pack", broken)
    with TieredCache(LAYOUT, config) as cache:
        assert store_pages(cache, {0: [(key(1), page(0, 1))], 1: [(key(1), page(1, 1))]})
        cache.drain()
        assert cache.pools.pool(1).refs_of(key(1)) == 0          # unpinned all the same
        assert cache.lookup(1, [key(1)]) == ["ram"]
    assert "2 background writes failed" in caplog.text and "injected" in caplog.text


def test_a_prefix_lookup_asks_the_slower_tiers_nothing_past_the_first_key_none_holds(tmp_path):
    """Attention pages serve only a run from the prompt's start: where no tier holds the
    first key RAM lacks, the disk is asked about that key alone; where one does, about all."""
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    with TieredCache(LAYOUT, config) as cache:
        assert store_pages(cache, {0: [(key(i), page(0, i)) for i in (1, 2, 4)]})
        cache.drain()
    with TieredCache(LAYOUT, config) as cache:
        assert cache.secondaries[0].wait_ready(30)
        misses = lambda: cache.stats()["tiers"]["fs"]["misses"]     # noqa: E731
        keys = [key(i) for i in (1, 2, 3, 4, 5)]
        assert cache.lookup(0, keys, prefix=True) == ["fs", "fs", None, "fs", None]
        assert misses() == 2
        assert cache.lookup(0, [key(9), *keys], prefix=True) == [None] * 6      # a miss from the start
        assert misses() == 3                                        # one key asked, not six
        assert cache.lookup(0, [key(9), *keys]) == [None, "fs", "fs", None, "fs", None]
        assert misses() == 6
