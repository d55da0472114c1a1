"""Shared RAM regions: attach, ownership, leases, committed space, pin hooks."""

import gc
import json
import logging
import os
import signal

import numpy as np
import pytest

from hybridkv.core.errors import HybridKVError
from hybridkv.ram import regions
from hybridkv.ram.regions import POPULATOR, SharedRegion, remove_stale_regions

from helpers.processes import spawn, worker
from helpers.smaps import mapped_bytes


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


@pytest.fixture
def small_window(monkeypatch):
    """A 1 MiB window, so the regions that show it stay small (their files live on disk)."""
    monkeypatch.setattr(regions, "MAP_AHEAD_BYTES", 1 << 20)
    return 1 << 20


def test_region_pages_are_mapped_ahead_of_use_by_creator_and_attacher(tmp_path):
    """A store's first copy into a slot must not pay a page fault per 4 KiB on the engine's
    step: once a slot is in use, every process mapping the region maps the next ones in the
    background, writing nothing. Before that nothing is mapped: it would compete with the
    first requests."""
    path = tmp_path / "hybridkv-mapped"
    slots, page = 64, 65536
    region = SharedRegion.create(path, slots, page)
    assert POPULATOR.wait(region, 60) and mapped_bytes(path) == 0
    region.write(3, np.full(page, 5, np.uint8))         # the copy maps its own pages
    assert mapped_bytes(path) == page
    region.map_ahead(4)
    assert POPULATOR.wait(region, 60)
    assert mapped_bytes(path) == slots * page
    out = worker("region-mapped", path, slots, page)
    assert out.returncode == 0, out.stderr
    before, after, total = map(int, out.stdout.split())
    assert (before, after) == (0, slots * page)
    assert total == 5 * page                   # mapping the pages changed no byte
    assert int(region.array.sum()) == 5 * page
    region.close()


def test_a_region_maps_the_slots_in_use_and_a_window_beyond_not_all_of_it(tmp_path, small_window):
    """Mapping a large region whole would cost every process a core for seconds at start;
    mapping a sliver more at every step would wake a thread at every step."""
    path, page, window = tmp_path / "hybridkv-window", 65536, small_window
    slots = 6 * window // page
    region = SharedRegion.create(path, slots, page)
    region.map_ahead(1)
    assert POPULATOR.wait(region, 60)
    assert mapped_bytes(path) == page + 2 * window        # the slot in use, two windows beyond
    region.map_ahead(window // page)                       # still a window ahead: nothing to do
    assert POPULATOR.wait(region, 60)
    assert mapped_bytes(path) == page + 2 * window
    region.map_ahead(2 * window // page)                   # less than a window ahead: on to two
    assert POPULATOR.wait(region, 60)
    assert mapped_bytes(path) == 4 * window               # needed 3 windows: mapped to 4
    region.map_ahead(slots)
    assert POPULATOR.wait(region, 60)
    assert mapped_bytes(path) == slots * page              # never past the end
    region.close()


def test_pages_of_any_size_map_in_whole_memory_pages(tmp_path, small_window):
    """Engines' pages are rarely 4 KiB multiples; a window ending inside a memory page must
    not leave the next one starting there (madvise refuses an unaligned start)."""
    path, page = tmp_path / "hybridkv-odd", 41060
    slots = 6 * small_window // page
    region = SharedRegion.create(path, slots, page)
    for used in (1, small_window // page + 1, 3 * small_window // page, slots):
        region.map_ahead(used)
        assert POPULATOR.wait(region, 60)
        assert mapped_bytes(path) >= min(slots * page, used * page + small_window)
    assert POPULATOR.unsupported is None
    assert mapped_bytes(path) >= slots * page
    region.close()


def test_a_region_nobody_closes_is_still_collected_and_removed(tmp_path):
    """The page-mapping thread must not keep a forgotten region, and its file, alive."""
    path = tmp_path / "hybridkv-forgotten"
    region = SharedRegion.create(path, 64, 65536)
    region.map_ahead(1)
    assert POPULATOR.wait(region, 60)
    del region
    gc.collect()
    assert not path.exists()


def test_closing_a_region_while_its_pages_map_stops_the_mapping(tmp_path, caplog):
    big = SharedRegion.create(tmp_path / "hybridkv-big", 64, 1 << 20)     # 64 MiB: four chunks
    big.map_ahead(64)
    with caplog.at_level(logging.WARNING, logger="hybridkv.ram.regions"):
        big.close()                             # waits for the chunk in progress, then unmaps
        after = SharedRegion.create(tmp_path / "hybridkv-after", 16, 65536)
        after.map_ahead(1)
        assert POPULATOR.wait(after, 60)        # the thread serves regions made later
    assert POPULATOR.mapped(big) is None        # forgotten, not mapped into a closed mapping
    assert not (tmp_path / "hybridkv-big").exists()
    assert mapped_bytes(tmp_path / "hybridkv-after") == 16 * 65536
    assert not caplog.records                   # no chunk ran into the unmapped region
    after.close()


def test_pin_hooks_of_two_processes_never_overlap(tmp_path):
    """cudaHostRegister of one region from several ranks at once is what the flock prevents."""
    path, log = tmp_path / "hybridkv-pinned", tmp_path / "pin.log"
    region = SharedRegion.create(path, 4, 4096)
    children = [spawn("region-pin", path, log, 2) for _ in range(3)]
    for child in children:
        assert child.wait(timeout=60) == 0
    assert log.read_text().split() == ["start", "end"] * 3
    region.close()


def test_a_locked_lease_is_live_whatever_pid_it_names(tmp_path):
    """An owner in another PID namespace writes a pid that means nothing here: the flock it
    holds decides, so its region survives; the same lease unlocked is stale."""
    import fcntl

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
