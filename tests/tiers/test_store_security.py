"""The store against a hostile local user: private modes whatever the umask, no adopted
directories, no symlink followed. A second, real uid plays the other user (a forked child
that drops to ``nobody``; the suite runs as root in CI, as it must to install packages)."""

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from hybridkv.core.errors import HybridKVError
from hybridkv.ram.regions import SharedRegion, process_start_time
from hybridkv.tiers import pagefile
from hybridkv.tiers.filesystem import MANIFEST, FilesystemTier, page_path

from helpers.cli import assert_one_line_error, cli
from helpers.tier_worker import LAYOUT, key, page

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")


def as_other_user(fn, groups=()) -> None:
    """Run ``fn`` in a forked child as uid/gid nobody (in ``groups``); fail the test if it fails there."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups(list(groups))
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        except BaseException as e:       # say why in the test's output
            print(f"as nobody: {e!r}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def modes(root):
    out = {}
    for dirpath, _, filenames in os.walk(root):
        out[dirpath] = stat.S_IMODE(os.lstat(dirpath).st_mode)
        for name in filenames:
            out[os.path.join(dirpath, name)] = stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode)
    return out


def test_pages_and_directories_are_private_whatever_the_umask(tmp_path):
    ids = tmp_path / "ids"
    ids.write_text(" ".join(str(3 + i % 200) for i in range(3 * 64 + 1)))
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "generate", "--prompt-ids", str(ids),
                           "--store", str(tmp_path / "store"), "--max-new-tokens", "2"],
                          capture_output=True, text=True, preexec_fn=lambda: os.umask(0), timeout=300)
    assert proc.returncode == 0, proc.stderr
    found = modes(tmp_path / "store")
    assert any(path.endswith(".pack") for path in found) and len(found) >= 5
    for path, mode in found.items():
        assert mode == (0o700 if os.path.isdir(path) else 0o600), (path, oct(mode))


def test_group_mode_is_shared_with_the_group_only(tmp_path):
    tier = FilesystemTier(tmp_path / "store", LAYOUT, mode="group")
    assert tier.write(0, key(1), page(0, 1))
    tier.close()
    for path, mode in modes(tmp_path / "store").items():
        assert mode == (0o2770 if os.path.isdir(path) else 0o660), (path, oct(mode))


def test_ram_regions_and_leases_are_private(tmp_path):
    old = os.umask(0)
    try:
        region = SharedRegion.create(tmp_path / "hybridkv-private", 2, 4096)
    finally:
        os.umask(old)
    assert {p.name: oct(m) for p, m in ((p, stat.S_IMODE(p.stat().st_mode)) for p in tmp_path.iterdir())} == {
        "hybridkv-private": "0o600", "hybridkv-private.lease": "0o600"}
    region.close()


def _crafted_store(tmp_path, ids_file):
    """Pages with valid headers and checksums but another user's payload, for our layout."""
    scratch = tmp_path / "scratch"
    assert cli("generate", "--prompt-ids", ids_file, "--store", scratch,
                   "--max-new-tokens", "2").returncode == 0
    files = {}
    for path in scratch.rglob("*"):
        rel = path.relative_to(scratch)
        if path.suffix == ".blk":
            group, hexkey = int(path.parent.parent.name[1:]), path.stem
            payload = np.random.default_rng(1).integers(0, 256, path.stat().st_size - pagefile.HEADER_BYTES,
                                                        dtype=np.uint8)
            files[rel] = pagefile.make_header(group, bytes.fromhex(hexkey), payload) + payload.tobytes()
        elif path.is_file():
            files[rel] = path.read_bytes()
    return files


@pytest.fixture
def shared_dir():
    """A sticky world-writable directory both users reach (pytest's tmp dirs are root-only)."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="hybridkv-shared-")
    os.chmod(path, 0o1777)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_a_store_another_user_made_is_refused_and_left_alone(tmp_path, shared_dir):
    ids = tmp_path / "ids"
    ids.write_text(" ".join(str(3 + (7 * i) % 200) for i in range(3 * 64 + 1)))
    files = _crafted_store(tmp_path, ids)
    planted = shared_dir / "store"

    def plant():
        os.umask(0)
        for rel, blob in sorted(files.items()):
            (planted / rel).parent.mkdir(parents=True, exist_ok=True, mode=0o777)
            (planted / rel).write_bytes(blob)

    as_other_user(plant)
    before = {p: p.read_bytes() for p in planted.rglob("*") if p.is_file()}
    proc = cli("generate", "--prompt-ids", ids, "--store", planted, "--max-new-tokens", "2")
    assert_one_line_error(proc, f"store directory {planted} belongs to nobody (uid {NOBODY})")
    assert {p: p.read_bytes() for p in planted.rglob("*") if p.is_file()} == before
    # a directory of ours that others may write into is refused as well
    open_dir = tmp_path / "loose"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    assert_one_line_error(cli("generate", "--prompt", "x", "--store", open_dir),
                          "is writable by group/others (mode 777)", f"chmod 700 {open_dir}")


def test_a_foreign_subdirectory_inside_our_store_is_refused(shared_dir):
    store = shared_dir / "ours"
    tier = FilesystemTier(store, LAYOUT)
    assert tier.write(0, key(1), page(0, 1))
    tier.close()
    gdir = tier.namespace / "g1"
    gdir.mkdir(mode=0o700)
    for d in (store, tier.namespace):
        os.chmod(d, 0o711)              # traversable, still not writable by others: accepted
    os.chmod(gdir, 0o777)               # let the other user in, as a careless chmod would

    def plant():
        (gdir / "ab").mkdir()

    as_other_user(plant)
    os.chmod(gdir, 0o700)
    with pytest.raises(HybridKVError, match="belongs to nobody"):
        FilesystemTier(store, LAYOUT)


def test_planted_symlinks_at_temp_names_clobber_nothing(tmp_path):
    namespace = tmp_path / "store" / LAYOUT.fingerprint()
    namespace.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "store", 0o700)
    victims = [tmp_path / f"victim{i}" for i in range(3)]
    for v in victims:
        v.write_bytes(b"precious" * 1000)
    # the names the old code used, predictable from the pid
    (namespace / f".{MANIFEST}.{os.getpid()}.tmp").symlink_to(victims[0])
    (namespace / f".direct-probe-{os.getpid()}").symlink_to(victims[1])
    tier = FilesystemTier(tmp_path / "store", LAYOUT, direct=False)
    path = page_path(tier.namespace, 0, key(5))
    tier.dirs.ensure(path.parent)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{process_start_time(os.getpid())}.{threading.get_ident()}.tmp")
    tmp.symlink_to(victims[2])          # exactly the temp name this thread will write
    assert tier.write(0, key(5), page(0, 5))
    out = np.empty(LAYOUT.group(0).page_bytes, np.uint8)
    assert tier.read(0, key(5), out) and np.array_equal(out, page(0, 5))
    tier.close()
    assert all(v.read_bytes() == b"precious" * 1000 for v in victims)
    assert stat.S_ISREG(os.lstat(namespace / MANIFEST).st_mode)
    assert json.loads((namespace / MANIFEST).read_text())["fingerprint"] == LAYOUT.fingerprint()


def test_admin_commands_keep_a_group_stores_rules(shared_dir):
    """verify and gc read the mode from the store's root: a group store written by two users is
    checked and collected as a whole, its quarantine made group-shared; a private store with
    another user's namespace in it is refused."""
    store = shared_dir / "group-store"
    tier = FilesystemTier(store, LAYOUT, mode="group")
    assert tier.write(0, key(1), page(0, 1))
    tier.close()

    def write_as_group_member():
        other = FilesystemTier(store, LAYOUT, mode="group")
        assert other.write(1, key(2), page(1, 2)) and other.write(0, key(3), page(0, 3))
        other.close()

    as_other_user(write_as_group_member, groups=[os.getegid()])
    theirs = page_path(tier.namespace, 0, key(3))
    assert os.lstat(theirs).st_uid == NOBODY
    with open(theirs, "r+b") as f:              # damage the other user's page
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    proc = cli("verify", "--store", store, "--json")
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout) == {"checked": 3, "ok": 2, "corrupt": 1, "quarantined": 1, "vanished": 0,
                                       "unreadable": 0}
    assert stat.S_IMODE(os.lstat(tier.namespace / "quarantine").st_mode) == 0o2770
    proc = cli("gc", "--store", store, "--max-bytes", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["removed_files"] == 2

    private = shared_dir / "private-store"
    FilesystemTier(private, LAYOUT).close()
    os.chmod(private, 0o755)

    def plant_namespace():
        ns = private / "f00d"
        ns.mkdir(mode=0o755)
        (ns / MANIFEST).write_text("{}")

    os.chmod(private, 0o777)
    as_other_user(plant_namespace)
    os.chmod(private, 0o755)
    assert_one_line_error(cli("verify", "--store", private), f"{private / 'f00d'} belongs to nobody")
