"""Where a filesystem store keeps its files and the small file operations every part shares.

A page file is ``<namespace>/g<group>/<2 hex>/<key hex>.blk``; packs are
``<namespace>/packs/<id>.pack``; corrupt files go to ``<namespace>/quarantine``. Nothing here
follows a symlink or keeps state.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import stat
import time
from pathlib import Path

import numpy as np

from hybridkv.core.errors import HybridKVError
from hybridkv.ram.regions import process_start_time
from hybridkv.tiers import packfile, pagefile
from hybridkv.tiers.store_dirs import StoreDirs

ALIGN = packfile.ALIGN      # O_DIRECT buffers, offsets and lengths: whole 4 KiB blocks
MANIFEST = "manifest.json"
QUARANTINE = "quarantine"
PACKS = "packs"
PAGE_SUFFIX = ".blk"                 # a page file is <key hex>.blk


def probe_direct_io(directory: Path) -> bool:
    """Does this filesystem accept O_DIRECT? (tmpfs and overlayfs do not.)"""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / f".direct-probe-{secrets.token_hex(8)}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, ALIGN)
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def page_file(namespace: str, group: int, key: bytes) -> str:
    """A page's file name, as a string: pathlib costs ~40 us a page on the read path."""
    hexkey = key.hex()
    return f"{namespace}/g{group}/{hexkey[:2]}/{hexkey}{PAGE_SUFFIX}"


def page_file_ident(path: str) -> bytes:
    """The index key of a page file's path (``page_file`` backwards)."""
    group_dir, _, name = path.rsplit("/", 3)[-3:]
    return page_ident(int(group_dir[1:]), bytes.fromhex(name[:-len(PAGE_SUFFIX)]))


def page_path(namespace: Path, group: int, key: bytes) -> Path:
    return Path(page_file(str(namespace), group, key))


def page_ident(group: int, key: bytes) -> bytes:
    """Index key of a page: group and key in one bytes object (a tuple of both costs 1.5x)."""
    return group.to_bytes(2, "big") + key


def split_ident(ident: bytes) -> tuple[int, bytes]:
    return int.from_bytes(ident[:2], "big"), ident[2:]


def pack_idents(table: np.ndarray) -> list[bytes]:
    """``page_ident`` of every page in a pack's table, built at numpy speed (a million at start-up)."""
    n = len(table)
    rows = np.empty((n, 2 + pagefile.MAX_KEY), np.uint8)
    rows[:, :2] = table["group"].astype(">u2").view(np.uint8).reshape(n, 2)
    rows[:, 2:] = table["key"]
    widths = table["key_len"].astype(np.intp) + 2
    if n and (widths == widths[0]).all():       # the usual case: one key size
        width = int(widths[0])
        blob = rows[:, :width].tobytes()
        return [blob[at: at + width] for at in range(0, n * width, width)]
    return [rows[i, :width].tobytes() for i, width in enumerate(widths.tolist())]


def check_size(got: int, want: int) -> None:
    if got != want:
        raise pagefile.CorruptPage(f"file has {'fewer' if got < want else 'more'} than {want} bytes")


def quarantine(namespace: Path, path: Path, dirs: StoreDirs) -> bool:
    """Move a bad page aside; False when the store does not let us (it is still never served)."""
    qdir = namespace / QUARANTINE
    try:
        dirs.ensure(qdir)
        os.replace(path, qdir / f"{path.parent.parent.name}-{path.name}.{time.time_ns()}")
    except FileNotFoundError:
        pass
    except (OSError, HybridKVError):
        return False
    return True


def write_all(fd: int, buffers) -> None:
    """``os.writev`` until every byte is written: a short write is resumed, no progress fails."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if len(v)]
    while views:
        n = os.writev(fd, views)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]


def regular_stat(path) -> os.stat_result | None:
    """The stat of a regular file at ``path`` itself (symlinks and directories are not pages)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def regular_size(path) -> int | None:
    st = regular_stat(path)
    return None if st is None else st.st_size


def tmp_owner_alive(name: str) -> bool:
    """Temp files are named ``.<key>.<pid>.<start>.<thread>.tmp``."""
    parts = name.split(".")
    try:
        pid, start = int(parts[-4]), int(parts[-3])
    except (IndexError, ValueError):
        return False
    return process_start_time(pid) == start


def touch_files(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.utime(path)


def open_page(path: str | Path, flags: int) -> int:
    """Open a page file itself, never what a symlink in its place points to."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise pagefile.CorruptPage("a symlink, not a page") from None
        raise

