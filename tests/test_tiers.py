import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hybridkv.cache import TieredCache
from hybridkv.config import CacheConfig
from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import layout_from_dict
from hybridkv.ram.regions import SharedRegion, remove_stale_regions
from hybridkv.tiers import pagefile
from hybridkv.tiers.filesystem import FilesystemTier, page_path

from conftest import run_cli
from helpers.tier_worker import LAYOUT, key, page

WORKER = Path(__file__).parent / "helpers" / "tier_worker.py"


def worker(*args, **kw):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    return subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=120, **kw)


def spawn(*args):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    return subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], stdout=subprocess.PIPE,
                            text=True, env=env)


# -- RAM regions ----------------------------------------------------------------------------
def test_region_attach_from_second_process_sees_same_bytes(tmp_path):
    path = tmp_path / "hybridkv-r"
    region = SharedRegion.create(path, 4, 4096)
    region.write(0, np.full(4096, 7, np.uint8))
    assert worker("region-attach", path).returncode == 0
    assert int(region.page(1)[10]) == 9          # written by the other process
    region.close()
    assert not path.exists()


def test_owner_unlinks_a_region_another_process_created(tmp_path):
    path = tmp_path / "hybridkv-other"
    child = spawn("region-create", path)
    assert child.stdout.readline().strip() == "ready"
    region = SharedRegion.attach(path, 4, 4096)
    assert int(region.page(0)[0]) == 7
    region.take_ownership()
    region.close()
    child.kill()
    child.wait()
    assert not path.exists()


def test_lease_cleanup_removes_killed_owners_region_only(tmp_path):
    dead, live = tmp_path / "hybridkv-dead", tmp_path / "hybridkv-live"
    victim, survivor = spawn("region-create", dead), spawn("region-create", live)
    assert victim.stdout.readline().strip() == "ready"
    assert survivor.stdout.readline().strip() == "ready"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    removed = remove_stale_regions(tmp_path)
    assert removed == [dead] and not dead.exists()
    assert live.exists()
    survivor.kill()
    survivor.wait()


def test_region_space_is_committed_at_creation_not_at_first_write(tmp_path):
    """A sparse region on a tmpfs that fills up later dies of SIGBUS; a committed one cannot."""
    region = SharedRegion.create(tmp_path / "hybridkv-committed", 64, 65536)
    st = os.stat(tmp_path / "hybridkv-committed")
    assert st.st_blocks * 512 >= 64 * 65536
    region.close()


def test_pin_hooks_of_two_processes_never_overlap(tmp_path):
    """cudaHostRegister of one region from several ranks at once is what the flock prevents."""
    path, log = tmp_path / "hybridkv-pinned", tmp_path / "pin.log"
    region = SharedRegion.create(path, 4, 4096)
    children = [spawn("region-pin", path, log) for _ in range(3)]
    for child in children:
        assert child.wait(timeout=60) == 0
    assert log.read_text().split() == ["start", "end"] * 3
    region.close()


def test_a_locked_lease_is_live_whatever_pid_it_names(tmp_path):
    """An owner in another PID namespace writes a pid that means nothing here: the flock it
    holds decides, so its region survives; the same lease unlocked is stale."""
    import fcntl
    import json

    region = tmp_path / "hybridkv-elsewhere"
    region.write_bytes(b"\0" * 4096)
    lease = tmp_path / "hybridkv-elsewhere.lease"
    lease.write_text(json.dumps({"pid": 999999999, "start_time": 1}))   # a pid no one has here
    fd = os.open(lease, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    assert remove_stale_regions(tmp_path) == [] and region.exists()
    os.close(fd)                                                      # the owner exits
    assert remove_stale_regions(tmp_path) == [region] and not lease.exists()


def test_failing_pin_hook_is_fatal_and_releases_everything(tmp_path):
    path = tmp_path / "hybridkv-pin"

    def hook(region):
        raise RuntimeError("cudaHostRegister returned 1")

    with pytest.raises(HybridKVError) as info:
        SharedRegion.create(path, 2, 4096, pin_hook=hook, rank=3)
    message = str(info.value)
    assert "rank 3" in message and str(path) in message and "8192 B" in message
    assert "cudaHostRegister returned 1" in message
    assert not path.exists() and not list(tmp_path.iterdir())


def test_region_larger_than_free_space_fails_clearly(tmp_path):
    with pytest.raises(HybridKVError, match="lower ram_bytes"):
        SharedRegion.create(tmp_path / "hybridkv-huge", 1 << 20, 1 << 30)
    assert not list(tmp_path.iterdir())


# -- filesystem tier ----------------------------------------------------------------------
def test_restart_in_fresh_process_restores_identical_pages(tmp_path):
    assert worker("write", tmp_path, 20).returncode == 0
    out = worker("read", tmp_path, 20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "restored 20"


def _written_tier(tmp_path, n=3, **kw):
    tier = FilesystemTier(tmp_path, LAYOUT, **kw)
    for i in range(n):
        for g in (0, 1):
            assert tier.write(g, key(i), page(g, i))
    return tier


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_damaged_page_is_a_miss_and_quarantined_while_other_groups_hit(tmp_path, damage):
    tier = _written_tier(tmp_path)
    path = page_path(tier.namespace, 1, key(1))
    if damage == "truncate":
        os.truncate(path, path.stat().st_size - 100)
    elif damage == "flip":
        blob = bytearray(path.read_bytes())
        blob[pagefile.HEADER_BYTES + 5000] ^= 0x01
        path.write_bytes(bytes(blob))
    else:  # a valid page of another key copied over this one
        path.write_bytes(page_path(tier.namespace, 1, key(2)).read_bytes())
    out = np.empty(16384, np.uint8)
    assert tier.read(1, key(1), out) is False
    assert tier.stats["corrupt"] == 1 and not path.exists()
    assert len(list((tier.namespace / "quarantine").iterdir())) == 1
    assert tier.contains(1, key(1)) is False
    got = np.empty(4096, np.uint8)
    assert tier.read(0, key(1), got) and np.array_equal(got, page(0, 1))
    tier.close()


def test_foreign_layout_misses(tmp_path):
    _written_tier(tmp_path).close()
    other = layout_from_dict({**LAYOUT.to_dict(), "model": "another-model"})
    tier = FilesystemTier(tmp_path, other)
    assert not tier.contains(0, key(0))
    tier.close()


def test_quota_evicts_least_recently_used(tmp_path):
    size = pagefile.HEADER_BYTES + 4096
    tier = FilesystemTier(tmp_path, LAYOUT, max_bytes=3 * size)
    for i in range(3):
        tier.write(0, key(i), page(0, i))
    tier.read(0, key(0), np.empty(4096, np.uint8))      # key 0 is now most recent
    tier.write(0, key(3), page(0, 3))
    assert [tier.contains(0, key(i)) for i in range(4)] == [True, False, True, True]
    assert tier.total_bytes() == 3 * size and tier.stats["evictions"] == 1
    tier.close()


def test_startup_scan_rebuilds_index_in_mtime_order(tmp_path):
    size = pagefile.HEADER_BYTES + 4096
    tier = FilesystemTier(tmp_path, LAYOUT)
    for i in range(3):
        tier.write(0, key(i), page(0, i))
        os.utime(page_path(tier.namespace, 0, key(i)), ns=(10**18 + i, 10**18 + (2 - i)))
    tier.close()
    again = FilesystemTier(tmp_path, LAYOUT, max_bytes=3 * size)
    assert again.total_bytes() == 3 * size
    again.write(0, key(9), page(0, 9))
    assert not again.contains(0, key(2))      # the oldest mtime went first
    again.close()


def test_kill_during_write_storm_serves_no_corrupt_page(tmp_path):
    child = spawn("write", tmp_path, 0, "--storm")
    assert child.stdout.readline().strip() == "storming"
    time.sleep(0.5)
    child.send_signal(signal.SIGKILL)
    child.wait()
    tier = FilesystemTier(tmp_path, LAYOUT)
    assert not list(tier.namespace.rglob("*.tmp"))
    served = 0
    for g, size in ((0, 4096), (1, 16384)):
        for path in (tier.namespace / f"g{g}").glob("*/*.blk"):
            out = np.empty(size, np.uint8)
            k = bytes.fromhex(path.stem)
            assert tier.read(g, k, out)
            assert np.array_equal(out, page(g, int.from_bytes(k, "big")))
            served += 1
    assert served > 50
    tier.close()


def test_two_writers_and_a_reader_never_see_a_partial_file(tmp_path):
    writers = [spawn("write", tmp_path, 0, "--storm") for _ in range(2)]
    for w in writers:
        assert w.stdout.readline().strip() == "storming"
    tier = FilesystemTier(tmp_path, LAYOUT)
    reads = 0
    deadline = time.time() + 2
    while time.time() < deadline:
        for path in list((tier.namespace / "g1").glob("*/*.blk"))[:20]:
            out = np.empty(16384, np.uint8)
            k = bytes.fromhex(path.stem)
            if tier.read(1, k, out):
                assert np.array_equal(out, page(1, int.from_bytes(k, "big")))
                reads += 1
    for w in writers:
        w.kill()
        w.wait()
    assert tier.stats["corrupt"] == 0 and reads > 0
    tier.close()


def test_unwritable_store_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(HybridKVError, match="cannot be created"):
        FilesystemTier(blocker / "store", LAYOUT)


def test_direct_io_and_buffered_agree(tmp_path):
    for direct in (False, True):
        tier = FilesystemTier(tmp_path / str(direct), LAYOUT, direct=direct)
        if direct and not tier.direct:
            continue
        tier.write(1, key(5), page(1, 5))
        out = np.empty(16384, np.uint8)
        try:
            assert tier.read(1, key(5), out) and np.array_equal(out, page(1, 5))
        finally:
            tier.close()


# -- tiering ------------------------------------------------------------------------------
def test_write_through_pins_until_written_then_promotes_after_restart(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    with TieredCache(LAYOUT, config) as cache:
        assert cache.store({0: [(key(1), page(0, 1))], 1: [(key(1), page(1, 1))]})
        assert cache.pools.pool(1).refs_of(key(1)) == 1     # pinned until poll sees the write land
        cache.drain()
        assert cache.pools.pool(1).refs_of(key(1)) == 0
    with TieredCache(LAYOUT, config) as cache:
        assert cache.locate(1, [key(1), key(2)]) == ["fs", None]
        views = cache.acquire({0: [key(1)], 1: [key(1)]})
        assert np.array_equal(views[1][0], page(1, 1))
        cache.release({0: [key(1)], 1: [key(1)]})
        assert cache.locate(1, [key(1)]) == ["ram"]
        assert cache.stats()["tiers"]["fs"]["hits"] == 2


def test_reserved_slots_filled_by_another_process_are_served_only_after_commit(tmp_path):
    """The vLLM worker's path: reserve, fill the shared slot from another process, commit."""
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path / "kv"))
    with TieredCache(LAYOUT, config) as cache:
        plans = cache.reserve({1: [key(7)]})
        assert cache.pools.pool(1).lookup(key(7)).value == "hit_pending"
        assert cache.acquire({1: [key(7)]}) is None            # never served half-written
        region = cache.regions[1]
        attached = SharedRegion.attach(region.path, region.slots, region.page_bytes)
        attached.write(plans[1].slots[0], page(1, 7))
        attached.close()
        cache.commit(plans)
        again = cache.reserve({1: [key(7)]})
        assert again is not None and not again[1].keys          # present now: nothing to reserve
        views = cache.acquire({1: [key(7)]})
        assert np.array_equal(views[1][0], page(1, 7))
        cache.release({1: [key(7)]})
        cache.drain()
    with TieredCache(LAYOUT, config) as cache:                   # written through to disk
        assert cache.locate(1, [key(7)]) == ["fs"]


def test_abandoned_reservation_leaves_no_page(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2)
    with TieredCache(LAYOUT, config) as cache:
        plans = cache.reserve({0: [key(8)], 1: [key(8)]})
        cache.commit(plans, ok=False)
        assert cache.locate(0, [key(8)]) == [None] and cache.locate(1, [key(8)]) == [None]
        assert cache.store({0: [(key(8), page(0, 8))], 1: [(key(8), page(1, 8))]})


def test_corrupt_secondary_page_fails_acquire_and_is_not_served(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    with TieredCache(LAYOUT, config) as cache:
        cache.store({1: [(key(4), page(1, 4))]})
    tier = FilesystemTier(tmp_path, LAYOUT)
    path = page_path(tier.namespace, 1, key(4))
    tier.close()
    os.truncate(path, 100)
    with TieredCache(LAYOUT, config) as cache:
        assert cache.acquire({1: [key(4)]}) is None
        assert cache.locate(1, [key(4)]) == [None]
        assert cache.pools.pool(1).lookup(key(4)).value == "miss"


def test_regions_are_removed_at_close(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, ram_dir=str(tmp_path))
    cache = TieredCache(LAYOUT, config)
    assert len(list(tmp_path.glob("hybridkv-*.lease"))) == 2
    cache.close()
    assert not list(tmp_path.iterdir())


# -- store CLI ----------------------------------------------------------------------------
def test_inspect_verify_gc_cli(tmp_path):
    _written_tier(tmp_path, n=4).close()
    out = json.loads(run_cli("inspect", "--store", tmp_path, "--json").stdout)
    ns = out["namespaces"][0]
    assert ns["model"] == "tier-test" and ns["quarantined"] == 0
    assert [(g["id"], g["kind"], g["files"]) for g in ns["groups"]] == [(0, "attention", 4), (1, "state", 4)]
    assert out["total_bytes"] == 4 * (4096 + 16384 + 2 * pagefile.HEADER_BYTES)

    proc = run_cli("verify", "--store", tmp_path, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == {"checked": 8, "ok": 8, "corrupt": 0, "quarantined": 0}
    victim = next((tmp_path / ns["fingerprint"] / "g1").glob("*/*.blk"))
    blob = bytearray(victim.read_bytes())
    blob[-1] ^= 0xFF
    victim.write_bytes(bytes(blob))
    proc = run_cli("verify", "--store", tmp_path, "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout) == {"checked": 8, "ok": 7, "corrupt": 1, "quarantined": 1}
    assert json.loads(run_cli("inspect", "--store", tmp_path, "--json").stdout)["namespaces"][0]["quarantined"] == 1

    proc = run_cli("gc", "--store", tmp_path, "--max-bytes", "10KiB", "--json")
    result = json.loads(proc.stdout)
    assert result["total_bytes"] <= 10 * 1024 and result["removed_files"] >= 5


def test_store_cli_errors(tmp_path):
    from conftest import assert_one_line_error
    assert_one_line_error(run_cli("inspect", "--store", tmp_path / "nope"), "does not exist")
    assert_one_line_error(run_cli("gc", "--store", tmp_path, "--max-bytes", "lots"), "--max-bytes")
    assert_one_line_error(run_cli("inspect"), "--store DIR or --remote URL")


def test_promotion_never_evicts_resident_pages_of_the_same_request(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    with TieredCache(LAYOUT, config) as cache:
        cache.store({0: [(key(i), page(0, i)) for i in range(3)]})
        cache.drain()
    small = LAYOUT.group(0).page_bytes * 3 + LAYOUT.group(1).page_bytes * 4
    with TieredCache(LAYOUT, config.replace(ram_bytes=small, reference_tokens=32)) as cache:
        assert cache.plan.token_slots == 3
        cache.acquire({0: [key(0)]})                    # key 0 promoted, then released
        cache.release({0: [key(0)]})
        cache.store({0: [(key(7), page(0, 7)), (key(8), page(0, 8))]})   # RAM now full
        cache.drain()
        views = cache.acquire({0: [key(0), key(1), key(2)]})
        assert views is not None
        for i in range(3):
            assert np.array_equal(views[0][i], page(0, i))


def test_promotion_waits_for_write_through_pins_instead_of_missing(tmp_path):
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    with TieredCache(LAYOUT, config) as cache:
        cache.store({0: [(key(i), page(0, i)) for i in range(3)]})
    small = LAYOUT.group(0).page_bytes * 3 + LAYOUT.group(1).page_bytes * 4
    with TieredCache(LAYOUT, config.replace(ram_bytes=small, reference_tokens=32)) as cache:
        cache.store({0: [(key(i), page(0, i)) for i in (7, 8, 9)]})   # RAM full, pinned until written
        assert all(cache.pools.pool(0).refs_of(key(i)) == 1 for i in (7, 8, 9))
        views = cache.acquire({0: [key(0), key(1), key(2)]})
        assert views is not None
        assert all(np.array_equal(views[0][i], page(0, i)) for i in range(3))
