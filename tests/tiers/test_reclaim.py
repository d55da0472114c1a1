"""Disk the store no longer serves from comes back: dead packs of earlier processes go, a
mostly-dead pack is compacted (its live pages survive a restart), and other namespaces count
against the quota, the least recently used going first."""

import os
import time

import numpy as np
from tiers.test_packs import check_index, packs, read_all, write_packed

from hybridkv.core.layout import layout_from_dict
from hybridkv.tiers import packfile
from hybridkv.tiers.admin import inspect_store
from hybridkv.tiers.filesystem import FilesystemTier

from helpers.tier_worker import LAYOUT, key, page

LIVE_PER_KEY = sum(packfile.aligned(g.page_bytes) for g in LAYOUT.groups)


def _disk(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _age(directory, seconds: float) -> None:
    """Files last used ``seconds`` ago (a store an older engine left behind)."""
    then = time.time() - seconds
    for p in directory.rglob("*"):
        os.utime(p, (then, then), follow_symlinks=False)


def test_a_write_storm_of_several_processes_leaves_disk_within_1_5x_of_the_live_pages(tmp_path):
    for _ in range(5):                       # five engines in turn rewrite the same pages
        tier = FilesystemTier(tmp_path, LAYOUT)
        assert tier.wait_scanned(30)
        write_packed(tier, range(20))
        tier.close()
    live = 20 * LIVE_PER_KEY
    (ns,) = inspect_store(tmp_path)["namespaces"]
    assert ns["packs"]["files"] == 5 and ns["packs"]["live_bytes"] == live
    assert ns["packs"]["dead_bytes"] == 4 * live
    tier = FilesystemTier(tmp_path, LAYOUT)
    assert tier.wait_scanned(30)
    assert tier.reclaim(grace_s=60)["dead_packs"] == 0      # just written: another engine may serve them
    done = tier.reclaim(grace_s=0)
    assert done["dead_packs"] == 4 and done["freed_bytes"] > 3 * live
    assert len(packs(tier)) == 1 and _disk(tier.namespace / "packs") <= 1.5 * live
    assert all(read_all(tier, range(20)))
    check_index(tier)
    tier.close()


def test_a_mostly_dead_pack_is_compacted_and_its_pages_survive_a_restart(tmp_path):
    first = FilesystemTier(tmp_path, LAYOUT)
    write_packed(first, range(10))
    (old,) = packs(first)
    first.close()
    second = FilesystemTier(tmp_path, LAYOUT)
    assert second.wait_scanned(30)
    write_packed(second, range(8))           # the old pack now serves keys 8 and 9 only
    done = second.reclaim(grace_s=0)
    assert done["compacted_packs"] == 1 and not old.exists()
    assert len(packs(second)) == 2
    check_index(second)
    second.close()
    third = FilesystemTier(tmp_path, LAYOUT)
    assert third.wait_scanned(30) and all(read_all(third, range(10)))
    (ns,) = inspect_store(tmp_path)["namespaces"]
    assert ns["packs"]["dead_bytes"] == 0 and ns["packs"]["live_bytes"] == 10 * LIVE_PER_KEY
    check_index(third)
    third.close()


def _layout(model: str):
    return layout_from_dict({**LAYOUT.to_dict(), "model": model})


def _fill(root, layout, keys) -> int:
    tier = FilesystemTier(root, layout)
    for i in keys:
        assert tier.write(0, key(i), page(0, i))
    tier.close()
    return sum(p.stat().st_size for p in tier.namespace.glob("g*/*/*.blk"))


def test_other_namespaces_count_against_the_quota_least_recently_used_first(tmp_path):
    older, newer = _layout("upgraded-twice-ago"), _layout("upgraded-once-ago")
    old_bytes = _fill(tmp_path, older, range(10))
    new_bytes = _fill(tmp_path, newer, range(10))
    _age(tmp_path / older.fingerprint(), 7200)
    _age(tmp_path / newer.fingerprint(), 3600)
    quota = new_bytes + 6 * (old_bytes // 10)           # room for the newer namespace and 6 pages
    tier = FilesystemTier(tmp_path, LAYOUT, max_bytes=quota)
    assert tier.wait_scanned(30)
    tier.reclaim()                           # after the pass the scan started in the background
    assert tier.stats["reclaimed_namespaces_removed"] == 1
    assert not (tmp_path / older.fingerprint()).exists() and (tmp_path / newer.fingerprint()).exists()
    for i in range(10):                      # the current namespace gets what the newer one leaves
        assert tier.write(0, key(i), page(0, i))
    assert tier.total_bytes() <= quota - new_bytes
    out = np.empty(LAYOUT.group(0).page_bytes, np.uint8)
    assert tier.read(0, key(9), out) and np.array_equal(out, page(0, 9))
    tier.close()
    assert _disk(tmp_path) - sum(p.stat().st_size for p in tmp_path.glob("*/manifest.json")) <= quota


def test_a_namespace_in_use_is_never_removed(tmp_path):
    _fill(tmp_path, _layout("another-model-serving-now"), range(10))
    tier = FilesystemTier(tmp_path, LAYOUT, max_bytes=1)
    assert tier.wait_scanned(30)
    tier.reclaim()
    assert tier.stats["reclaimed_namespaces_removed"] == 0
    assert (tmp_path / _layout("another-model-serving-now").fingerprint()).exists()
    tier.close()
