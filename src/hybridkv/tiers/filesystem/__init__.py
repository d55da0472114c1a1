"""The persistent filesystem tier: self-checking pages in page files and pack files.

Pages written close together share a pack file, ``root/<fingerprint>/packs/<id>.pack``
(``packfile``), so a restore reads them in a few large requests, straight into the RAM
slots, instead of one small request per page. A page larger than ``PACK_MAX_PAGE``, or one
written alone (``write``), has a file of its own,
``root/<fingerprint>/g<group>/<2 hex>/<key hex>.blk``. Every file is written under a temp
name and renamed into place, so a reader never sees a partial page, also across processes
and after ``kill -9``. Files that fail verification are quarantined and counted, never
served. A store this process cannot write (a read-only mount, another user's files) is
served read-only: what verifies is a hit, the rest a miss, and nothing is changed on disk.

The tier is a composition: ``paths`` (file names and small file operations), ``index`` (what
the store holds, in memory), ``scan`` (start-up scan and discovery), ``reads``, ``writes``;
``reclaim`` (dead packs, compaction, old namespaces); this module holds the lookups, the quota
and the tier's lifetime.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import Layout
from hybridkv.ram.regions import process_start_time
from hybridkv.tiers import pagefile
from hybridkv.tiers.base import SecondaryTier, register_tier
from hybridkv.tiers.filesystem.index import Pack, StoreIndex
from hybridkv.tiers.filesystem.paths import (
    MANIFEST,
    PACKS,
    PAGE_SUFFIX,
    QUARANTINE,
    open_page,
    page_file,
    page_file_ident,
    page_ident,
    page_path,
    probe_direct_io,
    quarantine,
    regular_stat,
    split_ident,
)
from hybridkv.tiers.filesystem.reads import RUN_BYTES, ReadMixin
from hybridkv.tiers.filesystem.reclaim import ReclaimMixin
from hybridkv.tiers.filesystem.scan import ScanMixin
from hybridkv.tiers.filesystem.writes import PACK_MAX_PAGE, WriteMixin
from hybridkv.tiers.io_queue import IOQueue
from hybridkv.tiers.store_dirs import StoreDirs

__all__ = ["MANIFEST", "PACKS", "PACK_MAX_PAGE", "QUARANTINE", "RUN_BYTES", "FilesystemTier", "open_page",
           "page_file", "page_path", "probe_direct_io", "quarantine", "regular_stat"]

log = logging.getLogger(__name__)


class FilesystemTier(ScanMixin, ReadMixin, WriteMixin, ReclaimMixin, SecondaryTier):
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
        self._packs_dir = f"{self._namespace_str}/{PACKS}"
        self.index = StoreIndex(self._namespace_str, self._packs_dir)
        self._packs_listed: int | None = None      # mtime of the packs directory we last listed
        self._packs_listed_at = 0.0                # and when (time.monotonic)
        self._pending: list[tuple[int, bytes, object, Future]] = []   # small pages to pack
        self._pending_bytes = 0
        self._flush_asked = False
        self._pending_ready = threading.Condition()
        self.packs_indexed = threading.Event()     # the scan has indexed the packs (its first part)
        self._undiscovered: set[bytes] = set()     # keys lookups missed, for the background to look for
        self._discovered = threading.Event()       # set while that discovery is idle
        self._discovered.set()
        self.scanned = threading.Event()           # the start-up scan has indexed the store
        self._scan_began = time.monotonic()        # its listing of the packs may name files gone since
        self._closing = False
        self._start = process_start_time(os.getpid())
        self._local = threading.local()            # per-thread aligned buffer and scratch page for O_DIRECT
        self.stats = {"reads": 0, "read_bytes": 0, "read_requests": 0, "writes": 0, "write_bytes": 0,
                      "corrupt": 0, "read_errors": 0, "write_errors": 0, "evictions": 0,
                      "orphans_removed": 0, "disk_lookups": 0, "pack_listings": 0,
                      "reclaimed_dead_packs": 0, "reclaimed_compacted_packs": 0, "reclaimed_freed_bytes": 0,
                      "reclaimed_namespaces_removed": 0}
        self._since_reclaim = 0                    # bytes written since the last reclaim pass
        self._reclaiming = False
        self._reclaim_lock = threading.Lock()     # one pass at a time
        self._others_bytes = 0                     # other namespaces' bytes the quota counts
        self._write_errnos: set[int] = set()      # failure kinds already logged
        self._bad: set[bytes] = set()              # corrupt page files we could not move aside
        self._bad_packs: set[str] = set()          # and packs
        page_dirs = self._check_dirs()
        self._io = IOQueue(threads, "hybridkv-fs")
        self._scanner = threading.Thread(target=self._scan, args=(page_dirs,), daemon=True,
                                         name="hybridkv-fs-scan")
        self._scanner.start()

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

    def contains(self, group: int, key: bytes) -> bool:
        """From the index (see ``contains_many``)."""
        return self.contains_many(group, [key])[0]

    def contains_many(self, group: int, keys) -> list[bool]:
        """From the index only: a lookup runs on the engine's scheduler thread and never waits
        for the disk. Keys it misses go to ``_discover``, so pages another process wrote since
        the scan (or that the scan has not reached) are found by a later lookup."""
        keys = list(keys)
        with self.index.lock:
            found = [where is not None for where in self.index.locate(group, keys)]
            unknown = [ident for n, ok in enumerate(found)
                       if not ok and (ident := page_ident(group, keys[n])) not in self._bad]
        if unknown:
            self._discover(unknown)
        return found

    def locate(self, group: int, key: bytes) -> tuple[str, int] | None:
        """The file holding a page and the offset of its payload there (tools, tests: it waits
        for the start-up scan, as no lookup does)."""
        self.wait_scanned(60)
        if not self.contains(group, key):
            return None
        with self.index.lock:
            where = self.index.locate(group, [key])[0]
        if isinstance(where, tuple):
            return f"{self._packs_dir}/{where[0].name}", where[0].offsets[where[1]]
        return page_file(self._namespace_str, group, key), pagefile.HEADER_BYTES

    def indexed_pages(self) -> int:
        with self.index.lock:
            return self.index.pages()

    def check(self) -> list[str]:
        """Inconsistencies between the index, itself and the disk (empty when sound), after
        the start-up scan: the index's own checks, every pack it holds is on disk at the size
        it counts, and every page file it holds is on disk at its size."""
        self.wait_scanned(60)
        with self.index.lock:
            problems = self.index.check()
            packs = {name: pack.nbytes for name, pack in self.index.packs.items()}
            files = {ident: size for ident, size in self.index.lru.items() if isinstance(ident, bytes)}
        for name, nbytes in packs.items():
            st = regular_stat(f"{self._packs_dir}/{name}")
            if st is None or st.st_size != nbytes:
                problems.append(f"pack {name}: indexed at {nbytes} B, on disk {st and st.st_size}")
        for ident, size in files.items():
            st = regular_stat(page_file(self._namespace_str, *split_ident(ident)))
            if st is None or st.st_size != size:
                problems.append(f"page file {ident.hex()}: indexed at {size} B, on disk {st and st.st_size}")
        return problems

    def total_bytes(self) -> int:
        """Bytes of the indexed files (while the start-up scan runs: those indexed so far)."""
        return self.index.bytes

    def _enforce_quota(self, keep: bytes | Pack | None) -> None:
        """Evict from the LRU end down to the quota (a packed page takes its whole pack along);
        the file just written stays, even alone over quota. Not before the scan has ordered
        the store, and never in a read-only store: its files cannot go, so its index keeps
        every page that is there."""
        if self.max_bytes is None or self.index.gone is not None or self.read_only:
            return
        with self.index.lock:               # O(evicted) per write: the LRU end of the order, no scan
            victims, evicted = self.index.evict_to(max(0, self.max_bytes - self._others_bytes), keep)
            self.stats["evictions"] += evicted
        self._remove(victims)

    def _forget(self, group: int, key: bytes) -> None:
        ident = page_ident(group, key)
        with self.index.lock:
            self.index.drop_file(ident)
            if self.index.gone is not None:
                self.index.gone.add(ident)
            self._went([page_file(self._namespace_str, group, key)])

    def _forget_pack(self, pack: Pack) -> None:
        """A pack is gone or damaged: none of its pages is served from it again."""
        with self.index.lock:
            self.index.drop_pack(pack)               # its file is gone or in quarantine already
            self._went([self.index.pack_file(pack.name)])

    def _remove(self, paths: list[str]) -> None:
        """Unlink files the index let go of (``StoreIndex.removing``), outside its lock."""
        if not paths:
            return
        for path in paths:
            if not self.read_only:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        with self.index.lock:
            # a page written again after the index let go of it and before the unlink lost
            # its new file to the unlink: it is not indexed either (a miss, never a phantom)
            rewritten = [path for path in paths if path not in self.index.removed and path.endswith(PAGE_SUFFIX)]
            for path in rewritten:
                if regular_stat(path) is None:
                    self.index.drop_file(page_file_ident(path))
            self._went([path for path in paths if path in self.index.removed])

    def _went(self, paths: list[str]) -> None:
        """(Under the index lock.) ``paths`` are gone from disk: a look for others' files
        running now may have seen them and must not index them; a later look cannot."""
        if self._discovered.is_set() and self.packs_indexed.is_set():    # no look runs or is due
            for path in paths:
                self.index.removed.pop(path, None)
        else:
            now = time.monotonic()
            for path in paths:
                self.index.removed[path] = now

    def _forget_removed(self) -> None:
        """(Under the index lock.) A look begins: what went before it cannot be seen, nor,
        while the start-up scan's listing of the packs runs, before that listing."""
        self.index.forget_removed_before(time.monotonic() if self.packs_indexed.is_set() else self._scan_began)

    def close(self) -> None:
        """Write the held pages and drain queued writes: a clean exit loses nothing acknowledged."""
        self._closing = True
        with self._pending_ready:
            self._pending_ready.notify_all()
        self._scanner.join()
        self._io.close()


register_tier("fs", "store", lambda root, layout, config: FilesystemTier(
    root, layout, config.fs_bytes, config.durability, mode=config.store_mode))
