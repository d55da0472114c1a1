"""Pack files: small pages written together share a file and come back in few large reads."""

import mmap
import os
import threading

import numpy as np
import pytest

from hybridkv.cache import TieredCache
from hybridkv.config import CacheConfig
from hybridkv.core.layout import layout_from_dict
from hybridkv.tiers import filesystem, packfile
from hybridkv.tiers.admin import gc_store, inspect_store, verify_store
from hybridkv.tiers.filesystem import FilesystemTier
from hybridkv.tiers.pagefile import CorruptPage

from helpers.processes import worker
from helpers.tier_worker import LAYOUT, key, page


def write_packed(tier, keys) -> None:
    """Pages of both groups for ``keys``, submitted as one batch and flushed: one pack."""
    items = [(g, key(i), page(g, i)) for i in keys for g in (0, 1)]
    futures = tier.submit_writes(items)
    tier.flush()
    assert all(f.result(timeout=30) for f in futures)


def read_all(tier, keys) -> list[bool]:
    items = [(g, key(i), np.empty(LAYOUT.group(g).page_bytes, np.uint8)) for i in keys for g in (0, 1)]
    ok = [f.result(timeout=30) for f in tier.submit_reads(items)]
    for (g, k, out), hit in zip(items, ok, strict=True):
        if hit:
            assert np.array_equal(out, page(g, int.from_bytes(k, "big")))
    return ok


def packs(tier) -> list:
    return sorted((tier.namespace / "packs").glob("*.pack"))


def flip(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))


def test_pages_written_together_share_one_pack_and_restore_in_one_read_after_a_restart(tmp_path):
    tier = FilesystemTier(tmp_path, LAYOUT)
    write_packed(tier, range(40))
    tier.close()
    assert len(packs(tier)) == 1 and not list(tier.namespace.rglob("*.blk"))
    again = FilesystemTier(tmp_path, LAYOUT)
    assert again.wait_ready(30)                  # an engine's start-up: the pack tables are read
    assert again.contains_many(1, [key(i) for i in range(41)]) == [True] * 40 + [False]
    assert all(read_all(again, range(40)))
    assert again.stats["reads"] == 80 and again.stats["read_requests"] == 1   # adjacent: one run
    again.close()


def test_reads_of_a_large_pack_are_split_into_runs_and_skip_gaps(tmp_path, monkeypatch):
    monkeypatch.setattr(filesystem.reads, "RUN_BYTES", 4 * (4096 + 16384) + 4096)   # 4 pairs of pages
    tier = FilesystemTier(tmp_path, LAYOUT)
    write_packed(tier, range(40))
    wanted = [i for i in range(40) if i != 20]                            # a gap splits a run too
    assert all(read_all(tier, wanted))
    assert tier.stats["read_requests"] == 10 and tier.stats["reads"] == 78   # 4+4+4+4+4, 4+4+4+4+3 pairs
    tier.close()


ODD_PAGES = layout_from_dict({
    "model": "odd-pages", "block_tokens": 16, "max_model_len": 4096,
    "groups": [{"id": 0, "kind": "attention", "page_bytes": 5000},
               {"id": 1, "kind": "state", "page_bytes": 12288}],
})


@pytest.mark.parametrize("layout", [LAYOUT, ODD_PAGES], ids=["4k-pages", "odd-pages"])
@pytest.mark.parametrize("slots", ["aligned", "unaligned"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_packed_pages_land_in_their_slots_whatever_the_alignment(tmp_path, layout, slots, direct):
    """O_DIRECT reads land in the slots themselves when those are whole 4 KiB blocks and go
    through an aligned buffer otherwise; buffered reads scatter into any slots, the padding
    between pages into a scratch buffer. Every way, one request and the right bytes."""
    rng = np.random.default_rng(7)
    pages = {(g, i): rng.integers(0, 256, layout.group(g).page_bytes, dtype=np.uint8)
             for i in range(6) for g in (0, 1)}
    writer = FilesystemTier(tmp_path, layout)
    futures = writer.submit_writes([(g, key(i), payload) for (g, i), payload in pages.items()])
    writer.flush()
    assert all(f.result(timeout=30) for f in futures)
    writer.close()
    tier = FilesystemTier(tmp_path, layout, direct=direct)
    assert tier.wait_scanned(30)
    region = np.frombuffer(mmap.mmap(-1, 1 << 20), np.uint8)
    at, items = (0 if slots == "aligned" else 1), []
    for (g, i), payload in pages.items():
        items.append((g, key(i), region[at: at + payload.nbytes]))
        at += packfile.aligned(payload.nbytes)
    assert [f.result(timeout=30) for f in tier.submit_reads(items)] == [True] * len(items)
    for (g, k, out) in items:
        assert np.array_equal(out, pages[(g, int.from_bytes(k, "big"))])
    assert tier.stats["read_requests"] == 1 and tier.stats["corrupt"] == 0
    tier.close()


@pytest.mark.parametrize("entries", [
    [(0, 8192), (4096, 100)],          # overlapping
    [(4096, 100), (0, 100)],           # out of file order
    [(100, 100)],                      # not on a 4 KiB boundary
    [(16384, 100)],                    # past the payloads, into the table
], ids=["overlap", "order", "unaligned", "outside"])
def test_a_table_whose_pages_overlap_or_stray_is_refused(entries):
    table = packfile.encode_table(packfile.make_table([(0, key(n), offset, length, 0)
                                                       for n, (offset, length) in enumerate(entries)]))
    blob = bytes(16384) + table
    with pytest.raises(CorruptPage, match="out of range"):
        packfile.parse_table(blob, len(blob))


def test_held_pages_are_written_at_flush(tmp_path, monkeypatch):
    monkeypatch.setattr(filesystem.writes, "PACK_LINGER_S", 600)
    tier = FilesystemTier(tmp_path, LAYOUT)
    futures = tier.submit_writes([(0, key(1), page(0, 1)), (1, key(1), page(1, 1))])
    assert not any(f.done() for f in futures) and not packs(tier)        # held for company
    tier.flush()
    assert all(f.result(timeout=30) for f in futures) and len(packs(tier)) == 1
    tier.close()


def test_close_writes_held_pages(tmp_path, monkeypatch):
    monkeypatch.setattr(filesystem.writes, "PACK_LINGER_S", 600)
    tier = FilesystemTier(tmp_path, LAYOUT)
    futures = tier.submit_writes([(0, key(1), page(0, 1))])
    tier.close()
    assert futures[0].result(timeout=0)
    again = FilesystemTier(tmp_path, LAYOUT)
    assert again.wait_ready(30) and again.contains(0, key(1))


def test_large_pages_keep_files_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setattr(filesystem.writes, "PACK_MAX_PAGE", 8192)                 # group 1's 16 KiB pages are large
    tier = FilesystemTier(tmp_path, LAYOUT)
    write_packed(tier, range(4))
    assert len(packs(tier)) == 1 and len(list(tier.namespace.glob("g1/*/*.blk"))) == 4
    assert all(read_all(tier, range(4)))
    tier.close()


def test_quota_evicts_the_least_recent_pack_whole(tmp_path):
    tier = FilesystemTier(tmp_path, LAYOUT)
    write_packed(tier, range(0, 10))
    size = tier.total_bytes()
    tier.close()
    tier = FilesystemTier(tmp_path, LAYOUT, max_bytes=2 * size + 100)
    assert tier.wait_scanned(30)
    write_packed(tier, range(10, 20))
    assert all(read_all(tier, [3]))                 # the first pack is now the more recent
    write_packed(tier, range(20, 30))
    assert tier.contains(0, key(3)) and tier.contains(1, key(25))
    assert not any(tier.contains(g, key(i)) for i in range(10, 20) for g in (0, 1))
    assert len(packs(tier)) == 2 and tier.total_bytes() == 2 * size
    assert tier.stats["evictions"] == 20
    tier.close()


def test_packs_and_page_files_age_together_by_mtime_across_a_restart(tmp_path):
    tier = FilesystemTier(tmp_path, LAYOUT)
    write_packed(tier, range(0, 3))
    tier.write(0, key(10), page(0, 10))
    write_packed(tier, range(3, 6))
    tier.close()
    file = filesystem.page_path(tier.namespace, 0, key(10))
    for stamp, path in enumerate([file, *packs(tier)]):  # the file oldest, then the packs
        os.utime(path, ns=(10**18 + stamp, 10**18 + stamp))
    older = packs(tier)[0]
    total = tier.total_bytes()
    tier = FilesystemTier(tmp_path, LAYOUT, max_bytes=total)
    assert tier.wait_scanned(30) and tier.total_bytes() == total
    tier.write(0, key(11), page(0, 11))                  # over quota: the file goes first
    assert not file.exists() and not tier.contains(0, key(10))
    assert len(packs(tier)) == 2 and tier.stats["evictions"] == 1
    tier.write(0, key(12), page(0, 12))                  # then the older pack, whole
    assert not older.exists() and len(packs(tier)) == 1 and tier.stats["evictions"] == 1 + 6
    kept = [packs(tier)[0], *(filesystem.page_path(tier.namespace, 0, key(i)) for i in (11, 12))]
    assert tier.total_bytes() == sum(path.stat().st_size for path in kept)
    assert tier.contains_many(0, [key(i) for i in range(6)]).count(True) == 3
    tier.close()


def test_a_page_stored_in_a_pack_and_a_page_file_is_served_from_the_newer(tmp_path):
    tier = FilesystemTier(tmp_path, LAYOUT)
    tier.write(0, key(1), page(0, 1))
    file = filesystem.page_path(tier.namespace, 0, key(1))
    write_packed(tier, range(3))                          # the packed copy serves; the file goes
    assert not file.exists() and tier.locate(0, key(1))[0].endswith(packfile.SUFFIX)
    tier.write(0, key(2), page(0, 2))                     # a page file serves; the pack stays
    assert tier.locate(0, key(2))[0].endswith(".blk") and len(packs(tier)) == 1
    assert all(read_all(tier, range(3)))
    assert tier.indexed_pages() == 6
    tier.close()
    again = FilesystemTier(tmp_path, LAYOUT)
    assert again.wait_scanned(30) and again.indexed_pages() == 6 and all(read_all(again, range(3)))
    again.close()


def test_a_pack_whose_pages_were_all_stored_again_by_us_is_removed(tmp_path):
    tier = FilesystemTier(tmp_path, LAYOUT)
    write_packed(tier, range(3))
    (first,) = packs(tier)
    write_packed(tier, range(3))
    assert len(packs(tier)) == 1 and packs(tier) != [first]
    assert all(read_all(tier, range(3)))
    tier.close()


def test_a_page_submitted_twice_before_a_flush_is_served_from_its_pack(tmp_path):
    tier = FilesystemTier(tmp_path, LAYOUT)
    futures = tier.submit_writes([(0, key(5), page(0, 5)), (0, key(5), page(0, 5))])
    tier.flush()
    assert [f.result(timeout=30) for f in futures] == [True, True]
    tier.close()
    again = FilesystemTier(tmp_path, LAYOUT)
    assert again.wait_scanned(30) and len(packs(again)) == 1
    out = np.empty(4096, np.uint8)
    assert again.read(0, key(5), out) and np.array_equal(out, page(0, 5))
    again.close()


def test_a_pack_another_process_wrote_is_found_without_a_restart(tmp_path):
    tier = FilesystemTier(tmp_path, LAYOUT)
    assert tier.wait_scanned(30) and not tier.contains(1, key(7))
    assert worker("write", tmp_path, 20).returncode == 0                 # writes through a cache
    assert packs(tier)
    assert not tier.contains(1, key(7))          # the lookup misses, and the background lists
    assert tier.wait_discovered(30)              # the new packs: the next lookup finds them
    assert tier.contains(1, key(7)) and all(read_all(tier, range(20)))
    tier.close()


def test_misses_relist_a_packs_directory_others_write_to_at_most_so_often(tmp_path, monkeypatch):
    tier = FilesystemTier(tmp_path, LAYOUT)
    write_packed(tier, range(2))                 # our own pack changes the directory too
    assert tier.wait_scanned(30) and not tier.contains(1, key(7)) and tier.wait_discovered(30)
    listings = tier.stats["pack_listings"]
    monkeypatch.setattr(filesystem.scan, "PACK_RELIST_S", 600)
    assert worker("write", tmp_path, 20).returncode == 0
    assert not tier.contains(1, key(7)) and tier.wait_discovered(30)
    assert not tier.contains(1, key(7))          # listed too recently: a miss, not a wrong hit
    assert tier.wait_discovered(30) and tier.stats["pack_listings"] == listings
    monkeypatch.setattr(filesystem.scan, "PACK_RELIST_S", 0)
    assert not tier.contains(1, key(7)) and tier.wait_discovered(30)
    assert tier.contains(1, key(7)) and all(read_all(tier, range(20)))
    assert tier.stats["pack_listings"] == listings + 1
    tier.close()


@pytest.mark.parametrize("where", ["page", "table"])
def test_a_damaged_pack_is_quarantined_and_none_of_its_pages_served(tmp_path, where):
    tier = FilesystemTier(tmp_path, LAYOUT)
    write_packed(tier, range(6))
    path, offset = tier.locate(1, key(2))
    tier.close()
    flip(path, offset + 7 if where == "page" else os.path.getsize(path) - 20)
    again = FilesystemTier(tmp_path, LAYOUT)
    assert again.wait_scanned(30)
    assert read_all(again, [2])[1] is False          # read_all checks every page it served
    assert not any(read_all(again, range(6)))        # the whole file went to quarantine
    assert again.stats["corrupt"] == 1 and not os.path.exists(path)
    assert len(list((again.namespace / "quarantine").iterdir())) == 1
    assert not again.contains(0, key(0))
    again.close()


def test_admin_commands_inspect_verify_and_collect_packs(tmp_path):
    tier = FilesystemTier(tmp_path, LAYOUT)
    write_packed(tier, range(5))
    write_packed(tier, range(5, 10))
    path, offset = tier.locate(0, key(7))
    tier.close()
    (ns,) = inspect_store(tmp_path)["namespaces"]
    live = 10 * sum(packfile.aligned(g.page_bytes) for g in LAYOUT.groups)
    assert ns["packs"] == {"files": 2, "bytes": sum(p.stat().st_size for p in packs(tier)), "pages": 20,
                           "live_bytes": live, "dead_bytes": 0}
    assert [g["packed_pages"] for g in ns["groups"]] == [10, 10]
    clean = {"checked": 2, "ok": 2, "corrupt": 0, "quarantined": 0, "vanished": 0, "unreadable": 0}
    assert verify_store(tmp_path, progress=False) == clean
    flip(path, offset)
    assert verify_store(tmp_path, progress=False) == {**clean, "ok": 1, "corrupt": 1, "quarantined": 1}
    assert gc_store(tmp_path, 0, progress=False)["removed_files"] == 1 and not packs(tier)


class HeldPackScan(FilesystemTier):
    """The real tier, with the first part of its scan (the pack tables) held."""

    def __init__(self, *args, **kwargs):
        self.go = threading.Event()
        super().__init__(*args, **kwargs)

    def _scan_packs(self):
        self.go.wait(30)
        return super()._scan_packs()


def test_lookups_never_wait_for_the_pack_tables_an_engine_waits_once_at_start_up(tmp_path, caplog):
    tier = FilesystemTier(tmp_path, LAYOUT)
    write_packed(tier, range(3))
    tier.close()
    held = HeldPackScan(tmp_path, LAYOUT)
    waits = []
    real_wait = held.packs_indexed.wait
    held.packs_indexed.wait = lambda timeout=None: waits.append(timeout) or real_wait(timeout)
    assert held.contains(0, key(1)) is False            # a miss, not a stall:
    assert waits == []                                  # the lookup did not wait at all
    assert held.wait_ready(0.05) is False               # what an engine does once, at start-up
    assert [r.getMessage() for r in caplog.records] == [
        f"filesystem tier {held.namespace}: the pack tables are still being read after 0 s; "
        "their pages are misses until then"]
    held.go.set()
    assert held.wait_ready(30) and held.contains(0, key(1))
    held.close()
    config = CacheConfig(block_tokens=16, ram_bytes=1024**2, store=str(tmp_path))
    with TieredCache(LAYOUT, config) as cache:          # an engine's cache: ready when it returns
        assert cache.lookup(0, [key(2)]) == ["fs"]


def test_keys_of_mixed_lengths_and_trailing_zero_bytes_survive_a_restart(tmp_path):
    """Tables are parsed as arrays of fixed 32-byte key fields: a key's own length decides."""
    keys = [b"\x07\x00", b"\x07", b"\x00" * 16, b"k" * 32, b"\x01\x00\x00"]
    tier = FilesystemTier(tmp_path, LAYOUT)
    futures = tier.submit_writes([(0, k, page(0, n)) for n, k in enumerate(keys)])
    tier.flush()
    assert all(f.result(timeout=30) for f in futures)
    tier.close()
    again = FilesystemTier(tmp_path, LAYOUT)
    assert again.wait_ready(30) and again.contains_many(0, keys) == [True] * len(keys)
    assert not again.contains(0, b"\x07\x00\x00")
    for n, k in enumerate(keys):
        out = np.empty(4096, np.uint8)
        assert again.read(0, k, out) and np.array_equal(out, page(0, n))
    again.close()


def check_index(tier) -> None:
    """The index agrees with itself and with the disk, and every pack on disk is indexed."""
    assert tier.check() == []
    assert tier.total_bytes() == sum(p.stat().st_size for p in packs(tier)) + sum(
        p.stat().st_size for p in tier.namespace.glob("g*/*/*.blk"))


@pytest.mark.parametrize("seed", range(3))
def test_random_writes_reads_evictions_and_restarts_keep_the_index_true(tmp_path, seed):
    """Pages written in packs and page files, read, evicted by a quota and found again after
    restarts: whatever the tier says it holds reads back right, and the index stays whole."""
    rng = np.random.default_rng(seed)
    quota = 40 * (4096 + 16384)
    tier = FilesystemTier(tmp_path, LAYOUT, max_bytes=quota)
    assert tier.wait_scanned(30)
    written, evictions = set(), 0
    for _ in range(60):
        op = rng.choice(["pack", "file", "read", "restart"], p=[0.4, 0.2, 0.3, 0.1])
        keys = rng.choice(30, size=int(rng.integers(1, 12)), replace=False).tolist()
        if op == "pack":
            pages = [(g, key(i), page(g, i)) for i in keys for g in (0, 1) if rng.random() < 0.8]
            assert tier.write_pack(pages) and written.update((g, k) for g, k, _ in pages) is None
        elif op == "file":
            g = int(rng.integers(0, 2))
            assert tier.write(g, key(keys[0]), page(g, keys[0]))
            written.add((g, key(keys[0])))
        elif op == "read":
            read_all(tier, keys)                           # what hits is checked inside
        else:
            evictions += tier.stats["evictions"]
            tier.close()
            tier = FilesystemTier(tmp_path, LAYOUT, max_bytes=quota)
            assert tier.wait_scanned(30)
        check_index(tier)
        held = [(g, key(i)) for g in (0, 1) for i in range(30) if tier.contains(g, key(i))]
        assert set(held) <= written and tier.indexed_pages() == len(held)
        assert tier.total_bytes() <= quota + 16384 + 4096 * 30   # one write may stay alone over
    evictions += tier.stats["evictions"]
    tier.close()
    assert evictions > 0                                   # the quota had work to do


class LooksBeforeUnlink(FilesystemTier):
    """A miss's look for pages other processes wrote (a stat of the missed pages' files, a
    listing of the packs directory) lands between an eviction taking files out of the index
    and unlinking them: the race the disk tier must not lose."""

    missed: set = frozenset()

    def _remove(self, paths):
        if paths and not getattr(self, "_looking", False):
            self._looking = True
            self._packs_listed, self._packs_listed_at = None, float("-inf")     # a listing is due now
            self._undiscovered = set(self.missed)
            self._discover_job()
            self._looking = False
        super()._remove(paths)


def test_a_listing_between_an_eviction_and_its_unlink_does_not_index_the_pack_again(tmp_path):
    tier = LooksBeforeUnlink(tmp_path, LAYOUT)
    assert tier.wait_scanned(30)
    assert tier.write_pack([(g, key(i), page(g, i)) for i in range(4) for g in (0, 1)])
    tier.max_bytes = tier.total_bytes() * 3 // 2      # room for one such pack: the next evicts it
    assert tier.write_pack([(g, key(i), page(g, i)) for i in range(4, 8) for g in (0, 1)])
    assert tier.stats["evictions"] == 8 and len(packs(tier)) == 1
    check_index(tier)                                  # the evicted pack is not indexed again
    assert tier.contains_many(0, [key(0), key(4)]) == [False, True]
    tier.close()


def test_a_stat_between_an_eviction_and_its_unlink_does_not_index_the_page_file_again(tmp_path):
    tier = LooksBeforeUnlink(tmp_path, LAYOUT)
    assert tier.wait_scanned(30)
    tier.missed = {filesystem.paths.page_ident(1, key(i)) for i in range(3)}
    assert tier.write(1, key(0), page(1, 0)) and tier.write(1, key(1), page(1, 1))
    tier.max_bytes = tier.total_bytes()                # room for two: the third evicts the first
    assert tier.write(1, key(2), page(1, 2))
    assert tier.stats["evictions"] == 1 and tier.stats["disk_lookups"] >= 3
    check_index(tier)                                  # the evicted file is not indexed again
    assert tier.contains_many(1, [key(0), key(2)]) == [False, True]
    tier.close()


def test_a_pack_written_before_the_start_up_listing_is_indexed_once(tmp_path):
    """An engine may store while the store is still being scanned: the scan's listing then
    names a pack this process has indexed already, which must not count twice."""
    held = HeldPackScan(tmp_path, LAYOUT)
    assert held.write_pack([(g, key(i), page(g, i)) for i in range(4) for g in (0, 1)])
    held.go.set()
    assert held.wait_scanned(30)
    check_index(held)
    assert held.total_bytes() == sum(p.stat().st_size for p in packs(held))
    held.close()


class WritesBeforeUnlink(FilesystemTier):
    """A page is stored again between its eviction taking it out of the index and the unlink
    (another request computed it meanwhile): the unlink then removes the new file."""

    rewrite: tuple = ()

    def _remove(self, paths):
        if paths and self.rewrite:
            (group, n), self.rewrite = self.rewrite, ()
            assert self.write(group, key(n), page(group, n))
        super()._remove(paths)


def test_a_page_written_again_while_its_eviction_unlinks_it_is_not_indexed_without_its_file(tmp_path):
    tier = WritesBeforeUnlink(tmp_path, LAYOUT)
    assert tier.wait_scanned(30)
    assert tier.write(1, key(0), page(1, 0)) and tier.write(1, key(1), page(1, 1))
    tier.max_bytes = tier.total_bytes()                # room for two: the third evicts the first
    tier.rewrite = (1, 0)
    assert tier.write(1, key(2), page(1, 2))
    check_index(tier)                                  # indexed only with its file
    out = np.empty(LAYOUT.group(1).page_bytes, np.uint8)
    for n in range(3):                                 # whatever it holds reads back right
        if tier.contains(1, key(n)):
            assert tier.read(1, key(n), out) and np.array_equal(out, page(1, n))
    tier.close()
