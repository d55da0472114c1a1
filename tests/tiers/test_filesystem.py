"""The filesystem tier: restarts, damage, quota, the start-up scan, concurrent writers."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import layout_from_dict
from hybridkv.tiers import pagefile
from hybridkv.tiers.filesystem import FilesystemTier, page_path

from helpers.processes import spawn, worker
from helpers.tier_worker import LAYOUT, key, page, written_tier


def test_restart_in_fresh_process_restores_identical_pages(tmp_path):
    assert worker("write", tmp_path, 20).returncode == 0
    out = worker("read", tmp_path, 20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "restored 20"


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_damaged_page_is_a_miss_and_quarantined_while_other_groups_hit(tmp_path, damage):
    tier = written_tier(tmp_path)
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
    written_tier(tmp_path).close()
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
    assert again.wait_scanned(30)
    assert again.total_bytes() == 3 * size
    again.write(0, key(9), page(0, 9))
    assert not again.contains(0, key(2))      # the oldest mtime went first
    again.close()


def test_batched_reads_fill_each_page_and_refresh_recency_across_a_restart(tmp_path):
    tier = FilesystemTier(tmp_path, LAYOUT)
    for i in range(10):
        for g in (0, 1):
            tier.write(g, key(i), page(g, i))
            os.utime(page_path(tier.namespace, g, key(i)), ns=(10**18 + i, 10**18 + i))
    total = tier.total_bytes()
    outs = [np.empty(16384, np.uint8) for _ in range(10)]
    futures = tier.submit_reads([(1, key(i), outs[i]) for i in range(10)])   # shared by 4 threads
    assert [f.result() for f in futures] == [True] * 10
    assert all(np.array_equal(outs[i], page(1, i)) for i in range(10))
    out = np.empty(4096, np.uint8)
    assert [f.result() for f in tier.submit_reads([(0, key(0), out), (0, key(42), out)])] == [True, False]
    tier.close()                        # drains the background mtime refresh
    again = FilesystemTier(tmp_path, LAYOUT, max_bytes=total)
    assert again.wait_scanned(30)
    again.write(0, key(99), page(0, 99))
    # the pages read are recent after the restart; of the rest, group 0's key 1 is the oldest
    assert not again.contains(0, key(1)) and again.stats["evictions"] == 1
    assert again.contains(0, key(0)) and all(again.contains(1, key(i)) for i in range(10))
    again.close()


class PausedScan(FilesystemTier):
    """The real tier, with its start-up scan held until the test lets it go."""

    def __init__(self, *args, **kwargs):
        self.go = threading.Event()
        super().__init__(*args, **kwargs)

    def _index_pages(self, page_dirs, packed):
        self.go.wait(30)
        super()._index_pages(page_dirs, packed)


def test_store_serves_before_its_scan_ends_and_keeps_order_and_quota_after(tmp_path):
    size = pagefile.HEADER_BYTES + 4096
    tier = FilesystemTier(tmp_path, LAYOUT)
    for i in range(4):
        tier.write(0, key(i), page(0, i))
        os.utime(page_path(tier.namespace, 0, key(i)), ns=(10**18 + i, 10**18 + i))
    tier.close()
    paused = PausedScan(tmp_path, LAYOUT, max_bytes=4 * size)
    out = np.empty(4096, np.uint8)
    assert not paused.scanned.is_set()
    assert not paused.contains(0, key(1))               # index-only: the lookup never waits on the disk,
    assert paused.wait_discovered(30)                  # the background looks for what it missed
    assert paused.contains(0, key(1)) and paused.stats["disk_lookups"] == 1   # found by one stat
    assert paused.read(0, key(1), out) and np.array_equal(out, page(0, 1))
    page_path(paused.namespace, 0, key(2)).unlink()     # another process removed it
    assert not paused.read(0, key(2), out)               # forgotten: the scan must not revive it
    for i in (8, 9):                                     # over the quota, which waits for the scan
        paused.write(0, key(i), page(0, i))
    assert all(page_path(paused.namespace, 0, key(i)).exists() for i in (0, 3, 8, 9))
    paused.go.set()
    assert paused.wait_scanned(30)
    # on disk 0, 1, 3 (scanned, 0 oldest), then 8, 9 (written during the scan): 5 pages, room for 4
    assert [paused.contains(0, key(i)) for i in (0, 1, 2, 3, 8, 9)] == [False, True, False, True, True, True]
    assert paused.total_bytes() == 4 * size and paused.stats["evictions"] == 1
    paused.close()


def test_kill_during_write_storm_serves_no_corrupt_page(tmp_path):
    child = spawn("write", tmp_path, 0, "--storm")
    assert child.stdout.readline().strip() == "storming"
    deadline = time.time() + 30                       # killed once three packs are down: mid-storm,
    while len(list(tmp_path.rglob("*.pack"))) < 3 and time.time() < deadline:   # packs in flight
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    tier = FilesystemTier(tmp_path, LAYOUT)
    assert tier.wait_scanned(30)                      # the scan reclaims orphans in the background
    assert not list(tier.namespace.rglob("*.tmp"))
    assert list(tier.namespace.rglob("*.pack"))       # the storm's pages were packed
    served = 0
    for g, size in ((0, 4096), (1, 16384)):
        for i in range(100_000):
            if not tier.contains(g, key(i)):
                break
            out = np.empty(size, np.uint8)
            assert tier.read(g, key(i), out)
            assert np.array_equal(out, page(g, i))
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
    while time.time() < deadline:             # packs the writers add are found as they land
        for i in range(0, 400, 20):
            out = np.empty(16384, np.uint8)
            if tier.contains(1, key(i)) and tier.read(1, key(i), out):
                assert np.array_equal(out, page(1, i))
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


def test_a_lookup_racing_close_neither_raises_nor_leaves_the_background_stuck(tmp_path):
    tier = FilesystemTier(tmp_path, LAYOUT)
    assert tier.wait_scanned(30)
    tier.close()
    assert tier.contains(0, key(1)) is False          # an engine thread still asking
    assert tier.wait_discovered(1)
