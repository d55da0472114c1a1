"""The persistent filesystem tier: one self-checking file per (group, key).

``root/<fingerprint>/g<group>/<2 hex>/<key hex>.blk``; writes go to a temp file that is
renamed into place, so a reader never sees a partial page, also across processes and
after ``kill -9``. Files that fail verification are quarantined and counted, never served.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import Layout
from hybridkv.ram.regions import process_start_time
from hybridkv.tiers import pagefile
from hybridkv.tiers.base import SecondaryTier, register_tier
from hybridkv.tiers.io_queue import READ, WRITE, IOQueue

log = logging.getLogger(__name__)
ALIGN = 4096
MANIFEST = "manifest.json"
QUARANTINE = "quarantine"


def probe_direct_io(directory: Path) -> bool:
    """Does this filesystem accept O_DIRECT? (tmpfs and overlayfs do not.)"""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / f".direct-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
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


def page_path(namespace: Path, group: int, key: bytes) -> Path:
    hexkey = key.hex()
    return namespace / f"g{group}" / hexkey[:2] / f"{hexkey}.blk"


def quarantine(namespace: Path, path: Path) -> None:
    qdir = namespace / QUARANTINE
    qdir.mkdir(exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, qdir / f"{path.parent.parent.name}-{path.name}.{time.time_ns()}")


def _tmp_owner_alive(name: str) -> bool:
    """Temp files are named ``.<key>.<pid>.<start>.<thread>.tmp``."""
    parts = name.split(".")
    try:
        pid, start = int(parts[-4]), int(parts[-3])
    except (IndexError, ValueError):
        return False
    return process_start_time(pid) == start


class FilesystemTier(SecondaryTier):
    name = "fs"

    def __init__(self, root: str | Path, layout: Layout, max_bytes: int | None = None,
                 durability: str = "none", direct: bool | None = None, threads: int = 4):
        self.root = Path(root)
        self.layout = layout
        self.namespace = self.root / layout.fingerprint()
        self.max_bytes = max_bytes
        self.fsync = durability == "fsync"
        try:
            self.namespace.mkdir(parents=True, exist_ok=True)
            self._write_manifest()
        except OSError as e:
            raise HybridKVError(
                f"store directory {self.root} is not writable ({e.strerror}); choose another --store"
            ) from None
        self.direct = probe_direct_io(self.namespace) if direct is None else direct
        self._lock = threading.Lock()
        self._index: OrderedDict = OrderedDict()   # (group, key) -> file bytes, LRU first
        self._bytes = 0
        self._start = process_start_time(os.getpid())
        self._local = threading.local()            # per-thread aligned buffer for O_DIRECT
        self.stats = {"reads": 0, "read_bytes": 0, "writes": 0, "write_bytes": 0,
                      "corrupt": 0, "read_errors": 0, "evictions": 0, "orphans_removed": 0}
        self._scan()
        self._io = IOQueue(threads, "hybridkv-fs")

    # -- start-up -------------------------------------------------------------------------
    def _write_manifest(self) -> None:
        path = self.namespace / MANIFEST
        if path.exists():
            return
        tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": pagefile.VERSION, "fingerprint": self.layout.fingerprint(),
                                   "model": self.layout.model, "layout": self.layout.to_dict()}, indent=2))
        os.replace(tmp, path)

    def _scan(self) -> None:
        """Rebuild the index from the files (oldest mtime first) and drop orphaned temp files."""
        found = []
        for gdir in self.namespace.glob("g*"):
            try:
                group = int(gdir.name[1:])
            except ValueError:
                continue
            for entry in gdir.glob("*/*"):
                name = entry.name
                if name.endswith(".tmp"):
                    if not _tmp_owner_alive(name):
                        entry.unlink(missing_ok=True)
                        self.stats["orphans_removed"] += 1
                    continue
                if not name.endswith(".blk"):
                    continue
                try:
                    st = entry.stat()
                    key = bytes.fromhex(name[:-4])
                except (OSError, ValueError):
                    continue
                found.append((st.st_mtime_ns, (group, key), st.st_size))
        found.sort()
        for _, ident, size in found:
            self._index[ident] = size
            self._bytes += size

    # -- lookups --------------------------------------------------------------------------
    def contains(self, group: int, key: bytes) -> bool:
        """From the index; a file another process wrote since our scan is picked up too."""
        ident = (group, key)
        with self._lock:
            if ident in self._index:
                return True
        try:
            size = page_path(self.namespace, group, key).stat().st_size
        except OSError:
            return False
        with self._lock:
            if ident not in self._index:
                self._index[ident] = size
                self._bytes += size
        return True

    def total_bytes(self) -> int:
        return self._bytes

    # -- reads ----------------------------------------------------------------------------
    def read(self, group: int, key: bytes, out: np.ndarray) -> bool:
        """Fill ``out`` (one page, uint8) from disk; False (and quarantine) if anything is off."""
        path = page_path(self.namespace, group, key)
        try:
            if self.direct:
                self._read_direct(path, group, key, out)
            else:
                self._read_buffered(path, group, key, out)
        except FileNotFoundError:
            self._forget(group, key)
            return False
        except pagefile.CorruptPage as e:
            log.warning("quarantined corrupt page %s: %s", path, e)
            quarantine(self.namespace, path)
            self._forget(group, key)
            with self._lock:
                self.stats["corrupt"] += 1
            return False
        except OSError as e:
            # EMFILE, EIO, EINTR...: the page may be healthy, so it stays; this read misses.
            log.warning("cannot read page %s: %s", path, e)
            with self._lock:
                self.stats["read_errors"] += 1
            return False
        with self._lock:
            self.stats["reads"] += 1
            self.stats["read_bytes"] += out.nbytes
            if (group, key) in self._index:
                self._index.move_to_end((group, key))
        with contextlib.suppress(OSError):
            os.utime(path)   # recency survives a restart
        return True

    def _read_buffered(self, path: Path, group: int, key: bytes, out: np.ndarray) -> None:
        header = bytearray(pagefile.HEADER_BYTES)
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != pagefile.HEADER_BYTES + out.nbytes:
                raise pagefile.CorruptPage(f"file has {size} bytes, expected {pagefile.HEADER_BYTES + out.nbytes}")
            got = os.readv(f.fileno(), [header, out])
        if got != size:
            raise pagefile.CorruptPage("short read")
        pagefile.verify(bytes(header), out, group, key)

    def _read_direct(self, path: Path, group: int, key: bytes, out: np.ndarray) -> None:
        want = pagefile.HEADER_BYTES + out.nbytes
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            size = os.fstat(fd).st_size
            if size != want:
                raise pagefile.CorruptPage(f"file has {size} bytes, expected {want}")
            buf = self._aligned(want)
            got = os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
        if got < want:
            raise pagefile.CorruptPage("short read")
        view = memoryview(buf)
        header, payload = view[: pagefile.HEADER_BYTES], view[pagefile.HEADER_BYTES:want]
        pagefile.verify(bytes(header), payload, group, key)
        np.copyto(out, np.frombuffer(payload, dtype=np.uint8))
        del header, payload, view

    def _aligned(self, nbytes: int) -> mmap.mmap:
        """This thread's page-aligned buffer, grown as needed (fresh mmaps would page-fault)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN)
            self._local.buf = buf
        return buf

    def submit_reads(self, items: list[tuple[int, bytes, np.ndarray]]) -> list[Future]:
        """One job per file so both I/O threads work; reads jump ahead of queued writes."""
        return [self._io.submit(READ, self.read, *item) for item in items]

    # -- writes ---------------------------------------------------------------------------
    def write(self, group: int, key: bytes, payload) -> bool:
        """Write one page atomically (temp file + rename); evict LRU files past the quota."""
        path = page_path(self.namespace, group, key)
        header = pagefile.make_header(group, key, payload)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{self._start}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if self.direct:
                self._write_direct(tmp, header, payload)
            else:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.writev(fd, [header, payload])
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(tmp, path)
            if self.fsync:
                dir_fd = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("filesystem tier could not write %s: %s", path, e)
            return False
        size = len(header) + len(memoryview(payload).cast("B"))
        with self._lock:
            old = self._index.pop((group, key), None)
            self._bytes += size - (old or 0)
            self._index[(group, key)] = size
            self.stats["writes"] += 1
            self.stats["write_bytes"] += size
        self._enforce_quota(keep=(group, key))
        return True

    def _write_direct(self, tmp: Path, header: bytes, payload) -> None:
        data = memoryview(payload).cast("B")
        want = len(header) + len(data)
        padded = -(-want // ALIGN) * ALIGN
        buf = self._aligned(want)
        buf[: len(header)] = header
        buf[len(header):want] = data
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            with memoryview(buf) as view:
                os.write(fd, view[:padded])
            os.ftruncate(fd, want)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def submit_writes(self, items: list[tuple[int, bytes, object]]) -> list[Future]:
        return [self._io.submit(WRITE, self.write, *item) for item in items]

    def _enforce_quota(self, keep) -> None:
        if self.max_bytes is None:
            return
        victims = []
        with self._lock:
            for ident in list(self._index):
                if self._bytes <= self.max_bytes:
                    break
                if ident == keep:
                    continue
                self._bytes -= self._index.pop(ident)
                victims.append(ident)
            self.stats["evictions"] += len(victims)
        for group, key in victims:
            page_path(self.namespace, group, key).unlink(missing_ok=True)

    def _forget(self, group: int, key: bytes) -> None:
        with self._lock:
            size = self._index.pop((group, key), None)
            if size is not None:
                self._bytes -= size

    def close(self) -> None:
        """Drain queued writes so a clean exit loses nothing acknowledged."""
        self._io.close()

    def contains_many(self, group: int, keys) -> list[bool]:
        return [self.contains(group, k) for k in keys]


register_tier("fs", "store", lambda root, layout, config: FilesystemTier(
    root, layout, config.fs_bytes, config.durability))
