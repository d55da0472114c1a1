"""The persistent filesystem tier: one self-checking file per (group, key).

``root/<fingerprint>/g<group>/<2 hex>/<key hex>.blk``; writes go to a temp file that is
renamed into place, so a reader never sees a partial page, also across processes and
after ``kill -9``. Files that fail verification are quarantined and counted, never served.
A store this process cannot write (a read-only mount, another user's files) is served
read-only: what verifies is a hit, the rest a miss, and nothing is changed on disk.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import secrets
import stat
import tempfile
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import Layout
from hybridkv.ram.regions import process_start_time
from hybridkv.tiers import pagefile
from hybridkv.tiers.base import ReadItem, SecondaryTier, register_tier
from hybridkv.tiers.io_queue import READ, WRITE, IOQueue, fan_out
from hybridkv.tiers.store_dirs import StoreDirs

log = logging.getLogger(__name__)
ALIGN = 4096
MANIFEST = "manifest.json"
QUARANTINE = "quarantine"


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
    return f"{namespace}/g{group}/{hexkey[:2]}/{hexkey}.blk"


def page_path(namespace: Path, group: int, key: bytes) -> Path:
    return Path(page_file(str(namespace), group, key))


def _ident(group: int, key: bytes) -> bytes:
    """Index key of a page: group and key in one bytes object (a tuple of both costs 1.5x)."""
    return group.to_bytes(2, "big") + key


def _group_key(ident: bytes) -> tuple[int, bytes]:
    return int.from_bytes(ident[:2], "big"), ident[2:]


def _check_size(got: int, want: int) -> None:
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
                 durability: str = "none", direct: bool | None = None, threads: int = 4,
                 mode: str = "private"):
        self.root = Path(root).absolute()
        self.layout = layout
        self.namespace = self.root / layout.fingerprint()
        self._namespace_str = str(self.namespace)
        self.max_bytes = max_bytes
        self.fsync = durability == "fsync"
        self.read_only = False
        self.dirs = StoreDirs(self.root, mode)
        try:
            self.dirs.ensure(self.root)
        except OSError as e:
            raise HybridKVError(
                f"store directory {self.root} cannot be created ({e.strerror}); choose another --store"
            ) from None
        try:
            self.dirs.ensure(self.namespace)
            if os.statvfs(self.namespace).f_flag & os.ST_RDONLY:
                raise OSError(errno.EROFS, "read-only file system")
            if not os.access(self.namespace, os.W_OK):
                raise PermissionError(errno.EACCES, "permission denied")
            self._write_manifest()
        except OSError as e:
            self.read_only = True
            log.warning("store %s is read-only (%s): serving the pages that verify, storing none",
                        self.root, e.strerror)
        self.direct = (not self.read_only and probe_direct_io(self.namespace)) if direct is None else direct
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()   # ident -> file bytes, LRU first
        self._bytes = 0
        self._sizes: dict[int, int] = {}           # one int object per distinct file size
        self._gone: set[bytes] | None = set()      # pages dropped while the scan runs; None after
        self.scanned = threading.Event()           # the start-up scan has indexed the store
        self._closing = False
        self._start = process_start_time(os.getpid())
        self._local = threading.local()            # per-thread aligned buffer for O_DIRECT
        self.stats = {"reads": 0, "read_bytes": 0, "writes": 0, "write_bytes": 0,
                      "corrupt": 0, "read_errors": 0, "write_errors": 0, "evictions": 0,
                      "orphans_removed": 0, "disk_lookups": 0}
        self._write_errnos: set[int] = set()      # failure kinds already logged
        self._bad: set[bytes] = set()              # corrupt pages we could not move aside
        page_dirs = self._check_dirs()
        self._io = IOQueue(threads, "hybridkv-fs")
        self._scanner = threading.Thread(target=self._scan, args=(page_dirs,), daemon=True,
                                         name="hybridkv-fs-scan")
        self._scanner.start()

    # -- start-up -------------------------------------------------------------------------
    def _write_manifest(self) -> None:
        path = self.namespace / MANIFEST
        if path.exists():
            return
        fd, tmp = tempfile.mkstemp(dir=self.namespace, prefix=f".{MANIFEST}.", suffix=".tmp")
        os.fchmod(fd, self.dirs.file_mode)
        with os.fdopen(fd, "w") as out:       # an unpredictable, freshly created name: no symlink games
            json.dump({"format": pagefile.VERSION, "fingerprint": self.layout.fingerprint(),
                       "model": self.layout.model, "layout": self.layout.to_dict()}, out, indent=2)
        os.replace(tmp, path)

    def _check_dirs(self) -> list[tuple[int, list[Path]]]:
        """The page directories of each group, each checked now: a directory another user
        controls is refused at open, not discovered later by the background scan."""
        if not self.namespace.is_dir():
            return []
        found = []
        for gdir in self.namespace.glob("g*"):
            try:
                group = int(gdir.name[1:])
            except ValueError:
                continue
            self.dirs.check(gdir)
            subs = list(gdir.iterdir())
            for sub in subs:
                self.dirs.check(sub)
            found.append((group, subs))
        return found

    def _scan(self, page_dirs: list[tuple[int, list[Path]]]) -> None:
        """Index the pages on disk, oldest mtime first, and drop orphaned temp files.

        Runs in the background so a store of a million pages opens at once; until it ends,
        a key the index lacks costs one ``stat`` (``contains``) and the quota waits.
        """
        try:
            self._index_pages(page_dirs)
        except Exception:   # the files stay the truth: lookups fall back to stat
            log.exception("filesystem tier: the start-up scan of %s failed", self.namespace)
            with self._lock:
                self._gone = None
        if not self._closing:
            self._enforce_quota(keep=None)
            self.scanned.set()

    def _index_pages(self, page_dirs: list[tuple[int, list[Path]]]) -> None:
        mtimes, idents, sizes = array("q"), [], array("q")
        for group, subs in page_dirs:
            for sub in subs:
                if self._closing:
                    return
                try:
                    with os.scandir(sub) as entries:
                        for entry in entries:
                            self._scan_entry(entry, group, mtimes, idents, sizes)
                except OSError:
                    continue
        order = np.argsort(np.frombuffer(mtimes, np.int64), kind="stable") if idents else []
        scanned = OrderedDict((idents[i], self._size(sizes[i])) for i in order)
        total = sum(sizes)
        with self._lock:
            for ident in self._gone:
                total -= scanned.pop(ident, 0)
            for ident, size in self._index.items():   # indexed since start-up: the most recent
                total += size - scanned.pop(ident, 0)
                scanned[ident] = size
            self._index, self._bytes, self._gone = scanned, total, None

    def _scan_entry(self, entry: os.DirEntry, group: int, mtimes, idents, sizes) -> None:
        name = entry.name
        if name.endswith(".tmp"):
            if not self.read_only and not _tmp_owner_alive(name):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    self.stats["orphans_removed"] += 1
            return
        if not name.endswith(".blk"):
            return
        try:
            st = entry.stat(follow_symlinks=False)
            key = bytes.fromhex(name[:-4])
        except (OSError, ValueError):
            return
        if stat.S_ISREG(st.st_mode):
            mtimes.append(st.st_mtime_ns)
            idents.append(_ident(group, key))
            sizes.append(st.st_size)

    def _size(self, nbytes: int) -> int:
        """The one int object for this size: a million index entries share a few."""
        return self._sizes.setdefault(nbytes, nbytes)

    def wait_scanned(self, timeout: float | None = None) -> bool:
        """Block until the start-up scan has indexed the store (tools, tests)."""
        return self.scanned.wait(timeout)

    # -- lookups --------------------------------------------------------------------------
    def contains(self, group: int, key: bytes) -> bool:
        """From the index; a file another process wrote since our scan is picked up too."""
        ident = _ident(group, key)
        with self._lock:
            if ident in self._index:
                return True
            if ident in self._bad:
                return False
            self.stats["disk_lookups"] += 1       # not indexed: maybe another process wrote it
        size = regular_size(page_file(self._namespace_str, group, key))
        if size is None:
            return False
        with self._lock:
            if ident not in self._index:
                self._index[ident] = self._size(size)
                self._bytes += size
        return True

    def indexed_pages(self) -> int:
        return len(self._index)

    def total_bytes(self) -> int:
        """Bytes of the indexed pages (while the start-up scan runs: those indexed so far)."""
        return self._bytes

    # -- reads ----------------------------------------------------------------------------
    def read(self, group: int, key: bytes, out: np.ndarray) -> bool:
        """Fill ``out`` (one page, uint8) from disk; False (and quarantine) if anything is off."""
        path = page_file(self._namespace_str, group, key)
        try:
            if self.direct:
                self._read_direct(path, group, key, out)
            else:
                self._read_buffered(path, group, key, out)
        except FileNotFoundError:
            self._forget(group, key)
            return False
        except pagefile.CorruptPage as e:
            moved = not self.read_only and quarantine(self.namespace, Path(path), self.dirs)
            log.warning("%s corrupt page %s: %s", "quarantined" if moved else "skipped", path, e)
            self._forget(group, key)
            if not moved:
                with self._lock:
                    self._bad.add(_ident(group, key))
            with self._lock:
                self.stats["corrupt"] += 1
            return False
        except OSError as e:
            # EMFILE, EIO, EINTR...: the page may be healthy, so it stays; this read misses.
            log.warning("cannot read page %s: %s", path, e)
            with self._lock:
                self.stats["read_errors"] += 1
            return False
        ident = _ident(group, key)
        with self._lock:
            self.stats["reads"] += 1
            self.stats["read_bytes"] += out.nbytes
            if ident in self._index:
                self._index.move_to_end(ident)
        return True

    def read_many(self, items: Sequence[ReadItem]) -> list[bool]:
        """Read pages one after another on this thread, then refresh their mtimes in the
        background (recency survives a restart; the inode update stays off the read path)."""
        results = [self.read(*item) for item in items]
        hits = [(group, key) for (group, key, _), ok in zip(items, results, strict=True) if ok]
        if hits and not self.read_only:
            with contextlib.suppress(RuntimeError):   # closing: recency is not worth a failure
                self._io.submit(WRITE, self._refresh_mtimes, hits)
        return results

    def _refresh_mtimes(self, pages: list[tuple[int, bytes]]) -> None:
        for group, key in pages:
            with contextlib.suppress(OSError):
                os.utime(page_file(self._namespace_str, group, key))

    def _read_buffered(self, path: str, group: int, key: bytes, out: np.ndarray) -> None:
        header, spare = bytearray(pagefile.HEADER_BYTES), bytearray(1)
        fd = open_page(path, os.O_RDONLY)
        try:
            got = os.readv(fd, [header, out, spare])   # the spare byte catches a longer file
        finally:
            os.close(fd)
        _check_size(got, pagefile.HEADER_BYTES + out.nbytes)
        pagefile.verify(bytes(header), out, group, key)

    def _read_direct(self, path: str, group: int, key: bytes, out: np.ndarray) -> None:
        want = pagefile.HEADER_BYTES + out.nbytes
        buf = self._aligned(want + 1)                 # room past the page catches a longer file
        fd = open_page(path, os.O_RDONLY | os.O_DIRECT)
        try:
            got = os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
        _check_size(got, want)
        with memoryview(buf) as view:
            pagefile.verify(bytes(view[: pagefile.HEADER_BYTES]), view[pagefile.HEADER_BYTES:want], group, key)
            np.copyto(out, np.frombuffer(view, np.uint8, out.nbytes, pagefile.HEADER_BYTES))

    def _aligned(self, nbytes: int) -> mmap.mmap:
        """This thread's page-aligned buffer, grown as needed (fresh mmaps would page-fault)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN)
            self._local.buf = buf
        return buf

    def submit_reads(self, items: Sequence[ReadItem]) -> list[Future]:
        """One job per I/O thread, each reading an interleaved share of the pages, so every
        thread keeps a read in flight without a queue round trip per page; reads jump ahead
        of queued writes."""
        shares = min(self._io.threads, len(items))
        futures: list[Future] = [None] * len(items)  # type: ignore[list-item]
        for i in range(shares):
            share = items[i::shares]
            batch = self._io.submit(READ, self.read_many, share)
            futures[i::shares] = fan_out(batch, len(share))
        return futures

    # -- writes ---------------------------------------------------------------------------
    def write(self, group: int, key: bytes, payload) -> bool:
        """Write one page atomically (temp file + rename); evict LRU files past the quota."""
        if self.read_only:
            return False
        path = page_path(self.namespace, group, key)
        header = pagefile.make_header(group, key, payload)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{self._start}.{threading.get_ident()}.tmp")
        try:
            self.dirs.ensure(path.parent)
            if self.direct:
                self._write_direct(tmp, header, payload)
            else:
                fd = self.dirs.create_file(tmp)
                try:
                    write_all(fd, [header, payload])
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
        except (OSError, HybridKVError) as e:   # HybridKVError: a directory is not safe to use
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._write_failed(path, e)
            return False
        size = len(header) + len(memoryview(payload).cast("B"))
        ident = _ident(group, key)
        with self._lock:
            self._bad.discard(ident)
            if self._gone is not None:
                self._gone.discard(ident)
            old = self._index.pop(ident, None)
            self._bytes += size - (old or 0)
            self._index[ident] = self._size(size)
            self.stats["writes"] += 1
            self.stats["write_bytes"] += size
        self._enforce_quota(keep=ident)
        return True

    def _write_direct(self, tmp: Path, header: bytes, payload) -> None:
        data = memoryview(payload).cast("B")
        want = len(header) + len(data)
        padded = -(-want // ALIGN) * ALIGN
        buf = self._aligned(want)
        buf[: len(header)] = header
        buf[len(header):want] = data
        fd = self.dirs.create_file(tmp, os.O_DIRECT)
        try:
            with memoryview(buf) as view:
                write_all(fd, [view[:padded]])
            os.ftruncate(fd, want)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def submit_writes(self, items: list[tuple[int, bytes, object]]) -> list[Future]:
        return [self._io.submit(WRITE, self.write, *item) for item in items]

    def _enforce_quota(self, keep: bytes | None) -> None:
        """Evict from the LRU end down to the quota; not before the scan has ordered the store."""
        if self.max_bytes is None or self._gone is not None:
            return
        victims = []
        with self._lock:               # O(evicted) per write: the LRU end of the index, no scan
            while self._bytes > self.max_bytes and len(self._index) > 1:
                ident, size = self._index.popitem(last=False)
                if ident == keep:      # the page just written stays, even alone over quota
                    self._index[ident] = size
                    continue
                self._bytes -= size
                victims.append(ident)
            self.stats["evictions"] += len(victims)
        for ident in victims:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(page_file(self._namespace_str, *_group_key(ident)))

    def _write_failed(self, path: Path, error: OSError | HybridKVError) -> None:
        """One log line per kind of failure, not one per page; a store gone read-only stays so."""
        with self._lock:
            self.stats["write_errors"] += 1
            code = getattr(error, "errno", None)
            first = code not in self._write_errnos
            self._write_errnos.add(code)
            if code in (errno.EROFS, errno.EACCES, errno.EPERM):
                self.read_only = True
        if first:
            log.warning("filesystem tier could not write %s: %s (further such failures are counted "
                        "in stats, not logged)", path, error)

    def _forget(self, group: int, key: bytes) -> None:
        ident = _ident(group, key)
        with self._lock:
            size = self._index.pop(ident, None)
            if size is not None:
                self._bytes -= size
            if self._gone is not None:
                self._gone.add(ident)

    def close(self) -> None:
        """Drain queued writes so a clean exit loses nothing acknowledged."""
        self._closing = True
        self._scanner.join()
        self._io.close()

    def contains_many(self, group: int, keys) -> list[bool]:
        return [self.contains(group, k) for k in keys]


def open_page(path: str | Path, flags: int) -> int:
    """Open a page file itself, never what a symlink in its place points to."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise pagefile.CorruptPage("a symlink, not a page") from None
        raise


register_tier("fs", "store", lambda root, layout, config: FilesystemTier(
    root, layout, config.fs_bytes, config.durability, mode=config.store_mode))
