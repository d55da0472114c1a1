"""The filesystem store under hostile-but-fair conditions: short writes, symlinks and
directories where pages should be, and a store this process may only read."""

import errno
import json
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest

from hybridkv.tiers import filesystem, pagefile
from hybridkv.tiers.admin import gc_store, inspect_store, verify_store
from hybridkv.tiers.filesystem import FilesystemTier, page_path

from helpers.cli import assert_one_line_error, cli
from helpers.tier_worker import LAYOUT, key, page, written_tier


def test_short_writes_are_resumed_until_the_page_is_whole(tmp_path, monkeypatch):
    real = os.writev

    def trickle(fd, buffers):           # the kernel may write less than asked
        first = memoryview(buffers[0]).cast("B")
        return real(fd, [first[:1000]])

    monkeypatch.setattr(filesystem.os, "writev", trickle)
    tier = FilesystemTier(tmp_path, LAYOUT, direct=False)
    assert tier.write(1, key(1), page(1, 1))
    monkeypatch.undo()
    out = np.empty(LAYOUT.group(1).page_bytes, np.uint8)
    assert tier.read(1, key(1), out) and np.array_equal(out, page(1, 1))
    tier.close()


def test_a_write_that_makes_no_progress_fails_and_publishes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(filesystem.os, "writev", lambda fd, buffers: 0)
    tier = FilesystemTier(tmp_path, LAYOUT, direct=False)
    assert tier.write(1, key(2), page(1, 2)) is False
    assert not page_path(tier.namespace, 1, key(2)).exists()
    assert not tier.contains(1, key(2)) and tier.stats["write_errors"] == 1
    assert not list(page_path(tier.namespace, 1, key(2)).parent.glob("*.tmp"))
    tier.close()


def test_symlink_in_place_of_a_page_is_a_miss_and_never_followed(tmp_path):
    tier = FilesystemTier(tmp_path / "store", LAYOUT, direct=False)
    assert tier.write(1, key(3), page(1, 3))
    target = tmp_path / "outside.blk"
    shutil.copy(page_path(tier.namespace, 1, key(3)), target)   # a valid page, outside the store
    secret = target.read_bytes()
    path = page_path(tier.namespace, 1, key(4))
    path.symlink_to(target)
    out = np.empty(LAYOUT.group(1).page_bytes, np.uint8)
    assert not tier.contains(1, key(4))
    assert tier.read(1, key(4), out) is False and not os.path.lexists(path)   # quarantined
    assert target.read_bytes() == secret                                      # untouched
    tier.close()
    # a new process's scan does not index a symlink either
    path.symlink_to(target)
    again = FilesystemTier(tmp_path / "store", LAYOUT, direct=False)
    assert again.wait_scanned(30) and not again.contains(1, key(4)) and again.contains(1, key(3))
    again.close()


def test_admin_commands_skip_dangling_links_and_directories_named_blk(tmp_path):
    tier = FilesystemTier(tmp_path / "store", LAYOUT, direct=False)
    assert tier.write(0, key(1), page(0, 1))
    tier.close()
    good = page_path(tier.namespace, 0, key(1))
    (good.parent / ("ab" * 16 + ".blk")).symlink_to(tmp_path / "nowhere")
    (good.parent / ("cd" * 16 + ".blk")).mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (good.parent / ("ef" * 16 + ".blk")).symlink_to(victim)
    inspected = inspect_store(tmp_path / "store")
    assert inspected["namespaces"][0]["groups"][0]["files"] == 1
    assert verify_store(tmp_path / "store", progress=False)["checked"] == 1
    assert gc_store(tmp_path / "store", 0, progress=False)["removed_files"] == 1
    assert victim.read_text() == "keep" and (good.parent / ("cd" * 16 + ".blk")).is_dir()
    proc = cli("inspect", "--store", tmp_path / "store", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["total_bytes"] == 0


def test_admin_commands_never_enter_a_symlinked_namespace_or_group(tmp_path):
    outside = tmp_path / "outside"
    tier = FilesystemTier(outside, LAYOUT, direct=False)
    assert tier.write(0, key(1), page(0, 1)) and tier.write(1, key(2), page(1, 2))
    tier.close()
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    store = tmp_path / "store"
    ours = FilesystemTier(store, LAYOUT, direct=False)
    ours.close()
    (store / ("f" * 4)).symlink_to(tier.namespace)             # a namespace that is a link
    (ours.namespace / "g1").symlink_to(tier.namespace / "g1")  # a group that is a link
    assert_one_line_error(cli("gc", "--store", store, "--max-bytes", "0", "--json"), "g1 is a symlink")
    os.unlink(ours.namespace / "g1")
    assert inspect_store(store)["total_bytes"] == 0
    assert gc_store(store, 0, progress=False)["removed_files"] == 0
    assert verify_store(store, progress=False)["checked"] == 0
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


def test_directories_an_older_version_left_readable_are_tightened(tmp_path):
    store = tmp_path / "store"
    tier = FilesystemTier(store, LAYOUT, direct=False)
    assert tier.write(0, key(1), page(0, 1))
    tier.close()
    _make_writable(store)                                 # what the old code left: 0755 / 0644
    os.chmod(page_path(tier.namespace, 0, key(1)).parent, 0o555)   # a deliberately read-only one
    again = FilesystemTier(store, LAYOUT, direct=False)
    out = np.empty(LAYOUT.group(0).page_bytes, np.uint8)
    assert again.read(0, key(1), out) and np.array_equal(out, page(0, 1))
    again.close()
    found = {p: stat.S_IMODE(p.lstat().st_mode) for p in [store, *store.rglob("*")] if p.is_dir()}
    assert found.pop(store) == 0o755                      # the root may hold other things: left
    assert found.pop(page_path(tier.namespace, 0, key(1)).parent) == 0o500   # only bits removed
    assert set(found.values()) == {0o700}, found


def _as_unprivileged():
    """Root ignores file modes; drop the capabilities that let it (setpriv is util-linux)."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]


def _make_read_only(root):
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o444)
        os.chmod(dirpath, 0o555)


def _make_writable(root):
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)


def _run_read_only(store, args):
    _make_read_only(store)
    try:
        cmd = [*_as_unprivileged(), sys.executable, "-m", "hybridkv", *map(str, args), "--store", str(store)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    finally:
        _make_writable(store)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "read-only" in proc.stderr.splitlines()[0]
    return proc


@pytest.mark.long
def test_read_only_store_serves_what_verifies_and_misses_the_rest(tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(3 + (i * 7) % 200) for i in range(5 * 64 + 3)))
    store = tmp_path / "store"
    common = ["generate", "--prompt-ids", ids, "--max-new-tokens", "4", "--json", "--ram-bytes", "64MiB"]
    filled = cli(*common, "--store", store)
    cold = json.loads(cli(*common, "--no-cache").stdout)
    assert filled.returncode == 0, filled.stderr
    (namespace,) = [p for p in store.iterdir() if p.is_dir()]
    pack = sorted((namespace / "packs").glob("*.pack"))[0]  # the request's pages are packed
    orphan = pack.parent / ".deadbeef.1.2.3.tmp"           # a crashed writer's leftover
    orphan.write_bytes(b"x")
    before = {p: p.read_bytes() for p in namespace.rglob("*") if p.is_file()}

    served = _run_read_only(store, common)
    assert len(served.stderr.strip().splitlines()) == 1
    warm = json.loads(served.stdout)
    assert warm["hit_tokens"] == 5 * 64 and warm["logits_digest"] == cold["logits_digest"]

    with open(pack, "r+b") as f:                          # now a corrupt page in it
        f.seek(pagefile.HEADER_BYTES + 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    before[pack] = pack.read_bytes()
    missed = _run_read_only(store, common)
    lines = missed.stderr.strip().splitlines()
    assert len(lines) == 2 and "skipped corrupt pack" in lines[1]
    result = json.loads(missed.stdout)
    assert result["hit_tokens"] < 5 * 64 and result["logits_digest"] == cold["logits_digest"]
    assert {p: p.read_bytes() for p in namespace.rglob("*") if p.is_file()} == before


def test_store_that_went_read_only_logs_once_and_stops_writing(tmp_path, caplog, monkeypatch):
    tier = FilesystemTier(tmp_path, LAYOUT, direct=False)

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(filesystem.os, "open", refuse)
    with caplog.at_level("WARNING", logger="hybridkv.tiers.filesystem"):
        results = [tier.write(0, key(i), page(0, i)) for i in range(5)]
    assert results == [False] * 5 and tier.read_only
    assert len([r for r in caplog.records if "could not write" in r.message]) == 1
    tier.close()


def test_a_read_only_store_over_its_quota_keeps_serving_every_page(tmp_path, monkeypatch):
    """Its files cannot be removed: evicting them from the index only lost live pages, and
    the failed unlink (EROFS) killed the scan thread."""
    written_tier(tmp_path / "store", n=4).close()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if mode == os.W_OK else real_access(path, mode, **kw))
    tier = FilesystemTier(tmp_path / "store", LAYOUT, max_bytes=1)
    assert tier.read_only and tier.wait_scanned(30)
    out = np.empty(LAYOUT.group(1).page_bytes, np.uint8)
    assert all(tier.contains(1, key(i)) and tier.read(1, key(i), out) for i in range(4))
    assert tier.stats["evictions"] == 0
    tier.close()
