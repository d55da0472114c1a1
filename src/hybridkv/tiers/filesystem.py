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
"""

from __future__ import annotations

import contextlib
import errno
import itertools
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
from hybridkv.tiers import packfile, page_index, pagefile
from hybridkv.tiers.base import ReadItem, SecondaryTier, register_tier
from hybridkv.tiers.io_queue import READ, WRITE, IOQueue, fan_out
from hybridkv.tiers.page_index import PageTable
from hybridkv.tiers.store_dirs import StoreDirs

log = logging.getLogger(__name__)
ALIGN = packfile.ALIGN      # O_DIRECT buffers, offsets and lengths: whole 4 KiB blocks
MANIFEST = "manifest.json"
QUARANTINE = "quarantine"
PACKS = "packs"
PACK_MAX_PAGE = 16 << 20    # pages up to this size are packed (a 10 MiB page read 0.78x raw from its own file, 1.1x packed)
PACK_BYTES = 8 << 20        # a pack is written once its pages reach this size,
PACK_LINGER_S = 1.0         # or this long after its first page, or at a flush (a request ended)
RUN_BYTES = 4 << 20         # the largest read of adjacent packed pages in one request,
RUN_PAGES = 512             # and its most pages (a page and its padding: two of IOV_MAX 1024)
PACK_RELIST_S = 0.1         # misses relist a packs directory others write to at most this often
DISCOVER_KEYS = 4096        # keys the lookups' background discovery holds at most (more: later misses)


class Pack:
    """A pack file as the index knows it: its size on disk; each page's group, fingerprint,
    offset and checksum (from the table, 34 B a page); how many of its pages are served from
    it (``live``); its number in the index's locations.

    A page stored again elsewhere leaves its old pack. A pack left with no page is removed at
    once if this process wrote it; one another process wrote may still serve that process,
    so it stays until the quota needs room, and goes first then."""

    __slots__ = ("name", "nbytes", "number", "groups", "fingerprints", "offsets", "checksums",
                 "live", "mine")

    def __init__(self, name: str, nbytes: int, table: np.ndarray, mine: bool = False):
        self.name, self.nbytes, self.number, self.live, self.mine = name, nbytes, -1, 0, mine
        self.groups = table["group"].astype(np.uint16)
        self.fingerprints = page_index.table_fingerprints(table["key"], table["key_len"])
        self.offsets = array("Q", table["offset"].astype(np.uint64).tobytes())
        self.checksums = array("Q", table["checksum"].astype(np.uint64).tobytes())

    def locations(self, entries: np.ndarray) -> np.ndarray:
        """Index locations of entries of this pack: its number and the entry, in one int64."""
        return (self.number << 32) | entries.astype(np.int64)


# Where a page lies: the bytes of its page file, or a pack and the page's entry in its table.
Where = int | tuple[Pack, int]
# A pack found on disk: it, its table, its mtime.
FoundPack = tuple[Pack, np.ndarray, int]


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


def _pack_idents(table: np.ndarray) -> list[bytes]:
    """``_ident`` of every page in a pack's table, built at numpy speed (a million at start-up)."""
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
        # The index: packed pages in a table per group (fingerprint -> pack number, entry),
        # page files in the recency order. The quota removes page files and whole packs, so
        # the order holds those: a page file's index key (value: its size) or a Pack
        # (value: its size), least recent first. A page is in a table or a file, not both.
        self._tables: dict[int, PageTable] = {}
        self._lru: OrderedDict[bytes | Pack, int] = OrderedDict()
        self._files = 0                            # page files in _lru
        self._bytes = 0
        self._packs: dict[str, Pack] = {}
        self._numbered: dict[int, Pack] = {}       # by Pack.number
        self._numbers = itertools.count()
        self._idle: dict[str, Pack] = {}           # packs serving no page here, oldest first
        self._packs_dir = f"{self._namespace_str}/{PACKS}"
        self._packs_listed: int | None = None      # mtime of the packs directory we last listed
        self._packs_listed_at = 0.0                # and when (time.monotonic)
        self._pending: list[tuple[int, bytes, object, Future]] = []   # small pages to pack
        self._pending_bytes = 0
        self._flush_asked = False
        self._pending_ready = threading.Condition()
        self._sizes: dict[int, int] = {}           # one int object per distinct file size
        self._gone: set[bytes] | None = set()      # page files dropped while the scan runs; None after
        self._fresh: set[bytes | Pack] | None = set()   # _lru keys used while it runs, not by it
        self.packs_indexed = threading.Event()     # the scan has indexed the packs (its first part)
        self._undiscovered: set[bytes] = set()     # keys lookups missed, for the background to look for
        self._discovered = threading.Event()       # set while that discovery is idle
        self._discovered.set()
        self.scanned = threading.Event()           # the start-up scan has indexed the store
        self._closing = False
        self._start = process_start_time(os.getpid())
        self._local = threading.local()            # per-thread aligned buffer and scratch page for O_DIRECT
        self.stats = {"reads": 0, "read_bytes": 0, "read_requests": 0, "writes": 0, "write_bytes": 0,
                      "corrupt": 0, "read_errors": 0, "write_errors": 0, "evictions": 0,
                      "orphans_removed": 0, "disk_lookups": 0, "pack_listings": 0}
        self._write_errnos: set[int] = set()      # failure kinds already logged
        self._bad: set[bytes] = set()              # corrupt page files we could not move aside
        self._bad_packs: set[str] = set()          # and packs
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
        if os.path.lexists(self._packs_dir):
            self.dirs.check(Path(self._packs_dir))
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
            packed = self._index_packs()
            self._index_pages(page_dirs, packed)
        except Exception:   # the files stay the truth: lookups fall back to stat
            log.exception("filesystem tier: the start-up scan of %s failed", self.namespace)
            with self._lock:
                self._gone = self._fresh = None
        self.packs_indexed.set()
        if not self._closing:
            self._enforce_quota(keep=None)
            self.scanned.set()

    def _index_packs(self) -> list[tuple[Pack, int]]:
        """First the packs (one table read each, few files): their pages are served from
        then on, while the page files are still being walked. Of a page in several packs,
        the newest pack's copy serves. Returns the packs and their mtimes (the tables,
        55 B a page, are not kept)."""
        packed = self._scan_packs()
        packed.sort(key=lambda found: found[2])
        with self._lock:
            self._add_packs([(pack, table) for pack, table, _ in reversed(packed)], newest=False,
                            fresh=False)
            for pack, _, _ in reversed(packed):     # by mtime, before what was used meanwhile
                if pack in self._lru:
                    self._lru.move_to_end(pack, last=False)
        self.packs_indexed.set()
        return [(pack, mtime) for pack, _, mtime in packed]

    def _index_pages(self, page_dirs: list[tuple[int, list[Path]]],
                     packed: list[tuple[Pack, int]]) -> None:
        """Index the page files and order them and the packs by mtime (least recent first)."""
        mtimes, idents, sizes = array("q"), [], []
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
        # Ordering a million entries takes a few hundred ms: it runs outside the lock, on a
        # snapshot, and only what changed meanwhile is reconciled under it, so a lookup (on
        # the engine's scheduler thread) never waits for the ordering.
        with self._lock:
            skip = set(self._packed_among(idents))   # files whose page a pack holds: it serves
            gone, known, fresh = set(self._gone), set(self._lru), set(self._fresh)
        stamps, keys, values = [], [], []
        for n, ident in enumerate(idents):  # not those dropped or indexed meanwhile
            if n not in skip and ident not in gone and ident not in known:
                stamps.append(mtimes[n])
                keys.append(ident)
                values.append(sizes[n])
        for pack, mtime in packed:
            if pack in known and pack not in fresh:
                stamps.append(mtime)
                keys.append(pack)
                values.append(pack.nbytes)
        order = np.argsort(np.array(stamps, np.int64), kind="stable").tolist()
        ordered = OrderedDict((keys[i], values[i]) for i in order)
        files = [(key, size) for key, size in zip(keys, values, strict=True) if not isinstance(key, Pack)]
        n_files, n_bytes = len(files), sum(size for _, size in files)
        with self._lock:
            # dropped since the snapshot; indexed, used or unpacked since (the latter go last)
            changed = (self._gone - gone) | (self._fresh - fresh) | (self._lru.keys() ^ known)
            skip_idents = [idents[n] for n in skip]
            if any(isinstance(key, Pack) for key in self._lru.keys() - known):
                # a pack written meanwhile may hold a scanned file's page: its copy serves
                scanned = [key for key in ordered if not isinstance(key, Pack)]
                now_packed = [scanned[n] for n in self._packed_among(scanned)]
                changed |= set(now_packed)
                skip_idents += now_packed
            for key in changed:
                size = ordered.pop(key, None)
                if size is not None and not isinstance(key, Pack):
                    n_files, n_bytes = n_files - 1, n_bytes - size
            self._files += n_files
            self._bytes += n_bytes
            for key, value in self._lru.items():   # used since start-up: the most recent
                ordered.setdefault(key, value)
            self._lru, self._gone, self._fresh = ordered, None, None
            # a file is stale only if its page is still packed and not indexed as a file now
            still = [skip_idents[n] for n in self._packed_among(skip_idents)]
            dead = [page_file(self._namespace_str, *_group_key(i)) for i in still if i not in self._lru]
        self._remove(dead)

    def _packed_among(self, idents: list[bytes]) -> list[int]:
        """Positions in ``idents`` of the pages a pack holds (callers hold self._lock)."""
        found = []
        for group, positions in _by_group([_group_key(i)[0] for i in idents]).items():
            locs = self._find_packed(group, [idents[n][2:] for n in positions])[1]
            found += [positions[i] for i in np.flatnonzero(locs >= 0).tolist()]
        return found

    def _scan_entry(self, entry: os.DirEntry, group: int, mtimes, idents, sizes) -> None:
        name = entry.name
        if self._reclaim_temp(entry):
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
            sizes.append(self._size(st.st_size))

    def _reclaim_temp(self, entry: os.DirEntry) -> bool:
        """Is this a temp file? One whose writer is gone is removed."""
        if not entry.name.endswith(".tmp"):
            return False
        if not self.read_only and not _tmp_owner_alive(entry.name):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                self.stats["orphans_removed"] += 1
        return True

    def _scan_packs(self) -> list[FoundPack]:
        """Every pack with its table and mtime; orphaned temp files are removed."""
        packed = []
        try:
            listed = os.stat(self._packs_dir).st_mtime_ns
            entries = list(os.scandir(self._packs_dir))
        except OSError:
            return packed
        for entry in entries:
            if self._closing:
                break
            if self._reclaim_temp(entry) or not entry.name.endswith(packfile.SUFFIX):
                continue
            found = self._open_pack(entry.name)
            if found is not None:
                packed.append(found)
        self._packs_listed = listed
        return packed

    def _open_pack(self, name: str) -> FoundPack | None:
        """A pack and its pages; a pack whose table does not verify is quarantined."""
        path = f"{self._packs_dir}/{name}"
        try:
            fd = open_page(path, os.O_RDONLY)
            try:
                st = os.fstat(fd)
                table = packfile.read_table(fd) if stat.S_ISREG(st.st_mode) else None
            finally:
                os.close(fd)
        except pagefile.CorruptPage as e:
            self._quarantine_pack(path, e)
            return None
        except OSError:
            return None
        if table is None:
            return None
        return Pack(name, st.st_size, table), table, st.st_mtime_ns

    def _quarantine_pack(self, path: str, error: Exception) -> bool:
        moved = not self.read_only and quarantine(self.namespace, Path(path), self.dirs)
        log.warning("%s corrupt pack %s: %s", "quarantined" if moved else "skipped", path, error)
        with self._lock:
            self.stats["corrupt"] += 1
        return moved

    def _size(self, nbytes: int) -> int:
        """The one int object for this size: a million index entries share a few."""
        return self._sizes.setdefault(nbytes, nbytes)

    def wait_scanned(self, timeout: float | None = None) -> bool:
        """Block until the start-up scan has indexed the store (tools, tests)."""
        return self.scanned.wait(timeout)

    # -- the index (callers hold self._lock) ----------------------------------------------
    def _used(self, key: bytes | Pack) -> None:
        """Note a use of a page file or pack while the scan runs: it outranks what the scan finds."""
        if self._fresh is not None:
            self._fresh.add(key)

    def _find_packed(self, group: int, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The keys' fingerprints and the location of each packed page (-1: not packed)."""
        fps, table = page_index.fingerprints(list(keys)), self._tables.get(group)
        return fps, table.find(fps) if table else np.full(len(keys), -1, np.int64)

    def _locate(self, group: int, keys: Sequence[bytes]) -> list[Where | None]:
        """Where each page lies, as the index knows it."""
        wheres: list[Where | None] = []
        for key, loc in zip(keys, self._find_packed(group, keys)[1].tolist(), strict=True):
            if loc >= 0:
                wheres.append((self._numbered[loc >> 32], loc & 0xFFFFFFFF))
            else:
                wheres.append(self._lru.get(_ident(group, key)) if self._files else None)
        return wheres

    def _put_file(self, ident: bytes, size: int) -> list[str]:
        """Index the newest copy of a page, in a page file (most recent); returns files no
        page uses now."""
        group, key = _group_key(ident)
        dead = self._unpack(group, [key])
        old = self._lru.pop(ident, None)
        self._files += old is None
        self._bytes += size - (old or 0)
        self._lru[ident] = size
        self._used(ident)
        return dead

    def _drop_file(self, ident: bytes) -> None:
        size = self._lru.pop(ident, None)
        if size is not None:
            self._files -= 1
            self._bytes -= size

    def _unpack(self, group: int, keys: list[bytes]) -> list[str]:
        """Unindex the packed copies of pages; returns files no page uses now."""
        fps, locs = self._find_packed(group, keys)
        held = locs >= 0
        if held.any():
            self._tables[group].remove(fps[held], locs[held])
        return self._release_packed(locs[held])

    def _release_packed(self, locs: np.ndarray) -> list[str]:
        """Pages left these locations: their packs serve fewer; returns files none uses now."""
        dead = []
        numbers, counts = np.unique(locs >> 32, return_counts=True)
        for number, count in zip(numbers.tolist(), counts.tolist(), strict=True):
            pack = self._numbered[number]
            pack.live -= count
            dead += self._bury(pack)
        return dead

    def _add_packs(self, found: list[tuple[Pack, np.ndarray]], newest: bool,
                   fresh: bool = True) -> list[str]:
        """Index packs' pages (most recent): all of them (``newest``: we just wrote the
        pack, its pages distinct) or those the index lacks, of a page in several packs the
        first pack's (another process wrote them; the scan passes the newest first).
        Returns files no page uses now."""
        for pack, _ in found:
            pack.number = next(self._numbers)
            self._numbered[pack.number] = pack
            self._packs[pack.name] = pack
            self._bytes += pack.nbytes
            self._lru[pack] = pack.nbytes
            if fresh:
                self._used(pack)
        dead = []
        for group in _groups_of(np.concatenate([pack.groups for pack, _ in found])) if found else []:
            parts = [(pack, table, np.flatnonzero(pack.groups == group)) for pack, table in found]
            fps = np.concatenate([pack.fingerprints[entries] for pack, _, entries in parts])
            locs = np.concatenate([pack.locations(entries) for pack, _, entries in parts])
            owners = np.concatenate([np.full(len(entries), n) for n, (_, _, entries) in enumerate(parts)])
            if self._files:                     # pages held in page files too
                idents = [i for _, table, entries in parts for i in _pack_idents(table[entries])]
                filed = np.array([ident in self._lru for ident in idents], bool)
                if newest:                      # the new copy serves: the file goes
                    for n in np.flatnonzero(filed).tolist():
                        self._drop_file(idents[n])
                        dead.append(page_file(self._namespace_str, group, idents[n][2:]))
                else:                           # the page file serves, as before
                    fps, locs, owners = fps[~filed], locs[~filed], owners[~filed]
            table = self._tables.setdefault(group, PageTable())
            old, indexed = table.put(fps, locs, replace=newest)
            dead += self._release_packed(old[indexed & (old >= 0)])
            for n, count in enumerate(np.bincount(owners[indexed], minlength=len(parts)).tolist()):
                parts[n][0].live += count
        for pack, _ in found:
            dead += self._bury(pack)
        return dead

    def _drop_pack(self, pack: Pack) -> list[str]:
        """Unindex every page of a pack and stop counting it; returns its path."""
        for group in _groups_of(pack.groups):
            table = self._tables.get(group)
            if table is not None:
                entries = np.flatnonzero(pack.groups == group)
                table.remove(pack.fingerprints[entries], pack.locations(entries))
        pack.live = 0
        return self._bury(pack, gone=True)

    def _bury(self, pack: Pack, gone: bool = False) -> list[str]:
        """A pack no page is served from: ours (or one ``gone`` already) stops counting and
        its path is returned for removal; another process's waits in ``_idle``."""
        if pack.live or self._packs.get(pack.name) is not pack:
            return []
        self._lru.pop(pack, None)
        if not (gone or pack.mine):
            self._idle[pack.name] = pack
            return []
        self._idle.pop(pack.name, None)
        del self._packs[pack.name]
        del self._numbered[pack.number]
        self._bytes -= pack.nbytes
        return [f"{self._packs_dir}/{pack.name}"]

    def _remove(self, paths: list[str]) -> None:
        for path in paths:
            if not self.read_only:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    # -- lookups --------------------------------------------------------------------------
    def contains(self, group: int, key: bytes) -> bool:
        """From the index (see ``contains_many``)."""
        return self.contains_many(group, [key])[0]

    def contains_many(self, group: int, keys) -> list[bool]:
        """From the index only: a lookup runs on the engine's scheduler thread and never waits
        for the disk. Keys it misses go to ``_discover``, so pages another process wrote since
        the scan (or that the scan has not reached) are found by a later lookup."""
        keys = list(keys)
        with self._lock:
            found = [where is not None for where in self._locate(group, keys)]
            unknown = [ident for n, ok in enumerate(found)
                       if not ok and (ident := _ident(group, keys[n])) not in self._bad]
        if unknown:
            self._discover(unknown)
        return found

    def _discover(self, idents: list[bytes]) -> None:
        """Look for pages lookups missed off the lookup path: an I/O thread stats their files
        and lists new packs, one job at a time; the lookup that missed recomputes."""
        with self._lock:
            if self._closing:
                return
            self._undiscovered.update(idents[:max(0, DISCOVER_KEYS - len(self._undiscovered))])
            if not self._discovered.is_set():
                return                    # the running job takes these too
            self._discovered.clear()
        try:
            self._io.submit(WRITE, self._discover_job)
        except RuntimeError:              # closed meanwhile: nothing will look
            self._idle_discovery()

    def _idle_discovery(self) -> None:
        with self._lock:
            self._undiscovered.clear()
            self._discovered.set()

    def _discover_job(self) -> None:
        try:
            while True:
                with self._lock:          # taking the keys and going idle are one step
                    idents, self._undiscovered = self._undiscovered, set()
                    if not idents or self._closing:
                        self._discovered.set()
                        return
                    self.stats["disk_lookups"] += len(idents)
                on_disk = {ident: size for ident in idents
                           if (size := regular_size(page_file(self._namespace_str, *_group_key(ident)))) is not None}
                dead = []
                with self._lock:
                    for ident, size in on_disk.items():
                        group, key = _group_key(ident)
                        if self._locate(group, [key])[0] is None:
                            dead += self._put_file(ident, self._size(size))
                self._remove(dead)
                self._list_new_packs()
        except Exception:                 # the next miss starts a fresh job
            log.exception("filesystem tier %s: looking for pages other processes wrote failed", self.namespace)
            self._idle_discovery()

    def wait_ready(self, timeout: float) -> bool:
        """The scan reads the pack tables first: milliseconds for most stores, about a second
        for a million packed pages. Engines wait for that part once, at start-up; if it takes
        longer, the pages of the packs not read yet are misses until it has (said once)."""
        if self.packs_indexed.wait(timeout):
            return True
        log.warning("filesystem tier %s: the pack tables are still being read after %.0f s; "
                    "their pages are misses until then", self.namespace, timeout)
        return False

    def wait_discovered(self, timeout: float) -> bool:
        """Wait until the keys lookups missed so far have been looked for (tools, tests)."""
        return self._discovered.wait(timeout)

    def _list_new_packs(self) -> None:
        """Index packs other processes wrote since we last listed: one ``stat`` when the
        packs directory is unchanged; nothing before the scan has read the tables. A store
        other processes keep writing changes all the time, and a listing costs ~1 ms per
        thousand packs, so misses list it at most every ``PACK_RELIST_S`` (a pack written
        since is a miss until then: a recompute, never a wrong hit)."""
        if not self.packs_indexed.is_set():
            return
        try:
            listed = os.stat(self._packs_dir).st_mtime_ns
            now = time.monotonic()
            if listed == self._packs_listed or now - self._packs_listed_at < PACK_RELIST_S:
                return
            names = [e.name for e in os.scandir(self._packs_dir) if e.name.endswith(packfile.SUFFIX)]
        except OSError:
            return
        self._packs_listed, self._packs_listed_at = listed, now
        with self._lock:
            self.stats["pack_listings"] += 1
        for name in names:
            if self._closing:
                return
            if name in self._packs or name in self._bad_packs:
                continue
            found = self._open_pack(name)
            if found is not None:
                pack, table, _ = found
                with self._lock:
                    if name not in self._packs:
                        self._add_packs([(pack, table)], newest=False)

    def locate(self, group: int, key: bytes) -> tuple[str, int] | None:
        """The file holding a page and the offset of its payload there (tools, tests: it waits
        for the start-up scan, as no lookup does)."""
        self.wait_scanned(60)
        if not self.contains(group, key):
            return None
        with self._lock:
            where = self._locate(group, [key])[0]
        if isinstance(where, tuple):
            return f"{self._packs_dir}/{where[0].name}", where[0].offsets[where[1]]
        return page_file(self._namespace_str, group, key), pagefile.HEADER_BYTES

    def indexed_pages(self) -> int:
        with self._lock:
            return self._files + sum(len(table) for table in self._tables.values())

    def total_bytes(self) -> int:
        """Bytes of the indexed files (while the start-up scan runs: those indexed so far)."""
        return self._bytes

    # -- reads ----------------------------------------------------------------------------
    def read(self, group: int, key: bytes, out: np.ndarray) -> bool:
        """Fill ``out`` (one page, uint8) from disk; False (and quarantine) if anything is off."""
        with self._lock:
            where = self._locate(group, [key])[0]
        if isinstance(where, tuple):
            return self.read_run(where[0], [(where[1], (group, key, out))])[0]
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
        self._served([(group, key, out)])
        return True

    def _served(self, items: Sequence[ReadItem], pack: Pack | None = None) -> None:
        """Count one read request serving ``items`` and refresh their recency (their pack's:
        the quota removes a pack whole, so it ages as one)."""
        with self._lock:
            self.stats["read_requests"] += 1
            self.stats["reads"] += len(items)
            self.stats["read_bytes"] += sum(out.nbytes for _, _, out in items)
            used = ([pack] if items else []) if pack is not None else [_ident(g, k) for g, k, _ in items]
            for key in used:
                if key in self._lru:
                    self._lru.move_to_end(key)
                    self._used(key)

    def read_many(self, items: Sequence[ReadItem]) -> list[bool]:
        """Read pages one after another on this thread, then refresh their mtimes in the
        background (recency survives a restart; the inode update stays off the read path)."""
        results = [self.read(*item) for item in items]
        hits = [page_file(self._namespace_str, group, key)
                for (group, key, _), ok in zip(items, results, strict=True) if ok]
        self._refresh_mtimes(hits)
        return results

    def read_run(self, pack: Pack, pages: list[tuple[int, ReadItem]]) -> list[bool]:
        """Read adjacent pages of a pack ((entry, item) in file order) in one request,
        straight into their RAM slots (see ``_read_span``)."""
        offsets, outs = pack.offsets, [out for _, (_, _, out) in pages]
        start = offsets[pages[0][0]]
        size = offsets[pages[-1][0]] + packfile.aligned(outs[-1].nbytes) - start
        path = f"{self._packs_dir}/{pack.name}"
        try:
            fd = open_page(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
            try:
                got, buf = self._read_span(fd, outs, start, size)
            finally:
                os.close(fd)
        except FileNotFoundError:            # another process evicted it
            self._forget_pack(pack)
            return [False] * len(pages)
        except (OSError, pagefile.CorruptPage) as e:
            log.warning("cannot read pack %s: %s", path, e)
            with self._lock:
                self.stats["read_errors"] += 1
            return [False] * len(pages)
        results, damage = [], None
        for entry, (_, _, out) in pages:
            at = offsets[entry] - start
            if got < at + out.nbytes:
                damage = damage or pagefile.CorruptPage("pack shorter than its table says")
            else:
                if buf is not None:
                    np.copyto(out, np.frombuffer(buf, np.uint8, out.nbytes, at))
                if pagefile.checksum(out) != pack.checksums[entry]:
                    damage = damage or pagefile.CorruptPage("payload checksum mismatch")
                else:
                    results.append(True)
                    continue
            results.append(False)
        if damage is not None:               # never serve from a damaged file again
            if not self._quarantine_pack(path, damage):
                with self._lock:
                    self._bad_packs.add(pack.name)
            self._forget_pack(pack)
        self._served([item for (_, item), ok in zip(pages, results, strict=True) if ok], pack)
        if any(results):
            self._refresh_mtimes([path])
        return results

    def _read_span(self, fd: int, outs: list[np.ndarray], start: int, size: int
                   ) -> tuple[int, memoryview | None]:
        """Read ``size`` bytes at ``start`` into the slots themselves, or, where ``O_DIRECT``
        refuses them (a slot not aligned to the device's blocks: EINVAL, raised before any
        I/O), into an aligned buffer the caller copies from. Asking the kernel costs less
        than checking each slot's address here (~1.4 µs a page)."""
        try:
            return os.preadv(fd, self._slot_vectors(outs), start), None
        except OSError as e:
            if not self.direct or e.errno != errno.EINVAL:
                raise
        buf = memoryview(self._aligned(size))[:size]
        return os.preadv(fd, [buf], start), buf

    def _slot_vectors(self, outs: list[np.ndarray]) -> list:
        """The slots of a run as one scatter list; the padding between pages lands in a
        scratch buffer."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = memoryview(mmap.mmap(-1, ALIGN))
        vectors = []
        for out in outs:
            vectors.append(out)
            pad = packfile.aligned(out.nbytes) - out.nbytes
            if pad:
                vectors.append(scratch[:pad])
        return vectors

    def _refresh_mtimes(self, paths: list[str]) -> None:
        """Touch the files read, in the background: recency survives a restart, and the inode
        update stays off the read path."""
        if paths and not self.read_only:
            with contextlib.suppress(RuntimeError):   # closing: recency is not worth a failure
                self._io.submit(WRITE, _touch, paths)

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
            buf = mmap.mmap(-1, packfile.aligned(nbytes))
            self._local.buf = buf
        return buf

    def submit_reads(self, items: Sequence[ReadItem]) -> list[Future]:
        """Packed pages are read in runs of adjacent pages, one request per run; page files
        in one job per I/O thread, each reading an interleaved share, so every thread keeps
        a read in flight without a queue round trip per page. Reads jump ahead of writes.
        The planning is numpy over the whole batch: the reads start only once it is done."""
        futures: list[Future] = [None] * len(items)  # type: ignore[list-item]
        locs, positions, files = [np.empty(0, np.int64)], [np.empty(0, np.int64)], []
        with self._lock:
            for group, at in _by_group([group for group, _, _ in items]).items():
                keys = [items[n][1] for n in at]
                found = self._find_packed(group, keys)[1]
                packed = found >= 0
                locs.append(found[packed])
                positions.append(np.asarray(at)[packed])
                files += [n for n, ok in zip(at, packed.tolist(), strict=True) if not ok]
            runs = self._pack_runs(np.concatenate(locs), np.concatenate(positions), items)
        batches = [(self._io.submit(READ, self.read_run, pack, list(zip(entries, map(items.__getitem__, run),
                                                                            strict=True))), run)
                   for pack, entries, run in runs]
        shares = min(self._io.threads, len(files))
        batches += [(self._io.submit(READ, self.read_many, [items[n] for n in files[i::shares]]), files[i::shares])
                    for i in range(shares)]
        for batch, positions in batches:     # the reads are under way meanwhile
            for n, future in zip(positions, fan_out(batch, len(positions)), strict=True):
                futures[n] = future
        return futures

    def _pack_runs(self, locs: np.ndarray, positions: np.ndarray, items: Sequence[ReadItem]
                   ) -> list[tuple[Pack, list[int], list[int]]]:
        """Packed pages (index locations, positions in ``items``) as runs of adjacent pages
        of one pack in file order, of at most ``RUN_BYTES`` and ``RUN_PAGES`` each:
        (pack, entries, positions) per run."""
        if not len(locs):
            return []
        order = np.argsort(locs, kind="stable")
        locs, positions = locs[order], positions[order]
        numbers, entries = locs >> 32, locs & 0xFFFFFFFF
        spans = packfile.aligned(np.fromiter((items[n][2].nbytes for n in positions.tolist()), np.int64,
                                             len(positions)))
        new_pack = numbers[1:] != numbers[:-1]
        cuts = (np.flatnonzero(new_pack) + 1).tolist()
        offsets = np.empty(len(locs), np.int64)
        for lo, hi in zip([0, *cuts], [*cuts, len(locs)], strict=True):
            table = np.frombuffer(self._numbered[int(numbers[lo])].offsets, np.uint64)
            offsets[lo:hi] = table[entries[lo:hi]]
        breaks = np.flatnonzero(new_pack | (offsets[1:] != offsets[:-1] + spans[:-1])) + 1
        ends = np.cumsum(spans)
        runs = []
        for lo, hi in zip([0, *breaks.tolist()], [*breaks.tolist(), len(locs)], strict=True):
            while lo < hi:        # greedy: as many pages as fit RUN_BYTES and RUN_PAGES, at least one
                last = int(np.searchsorted(ends, ends[lo] - spans[lo] + RUN_BYTES, "right"))
                stop = min(hi, lo + RUN_PAGES, max(last, lo + 1))
                runs.append((self._numbered[int(numbers[lo])], entries[lo:stop].tolist(),
                             positions[lo:stop].tolist()))
                lo = stop
        return runs

    # -- writes ---------------------------------------------------------------------------
    def write(self, group: int, key: bytes, payload) -> bool:
        """Write one page file atomically (temp file + rename); evict LRU files past the quota."""
        if self.read_only:
            return False
        path = page_path(self.namespace, group, key)
        header = pagefile.make_header(group, key, payload)
        tmp = path.with_name(f".{path.stem}.{self._writer_tag()}.tmp")
        try:
            self.dirs.ensure(path.parent)
            self._write_file(tmp, [header, payload])
            os.replace(tmp, path)
            self._sync_dir(path.parent)
        except (OSError, HybridKVError) as e:   # HybridKVError: a directory is not safe to use
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._write_failed(path, e)
            return False
        size = len(header) + len(memoryview(payload).cast("B"))
        ident = _ident(group, key)
        with self._lock:
            self._bad.discard(ident)
            dead = self._put_file(ident, self._size(size))
            self.stats["writes"] += 1
            self.stats["write_bytes"] += size
        self._remove(dead)
        self._enforce_quota(keep=ident)
        return True

    def write_pack(self, pages: list[tuple[int, bytes, object]]) -> bool:
        """Write pages as one pack file atomically; evict LRU files past the quota. Of a page
        given twice, the last copy is written."""
        if self.read_only:
            return False
        pages = list({(group, key): (group, key, payload) for group, key, payload in pages}.values())
        buffers, table = packfile.encode(pages)
        name = f"{secrets.token_hex(8)}{packfile.SUFFIX}"
        path = Path(self._packs_dir) / name
        tmp = path.with_name(f".{name}.{self._writer_tag()}.tmp")
        try:
            self.dirs.ensure(path.parent)
            self._write_file(tmp, buffers)
            os.replace(tmp, path)
            self._sync_dir(path.parent)
        except (OSError, HybridKVError) as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._write_failed(path, e)
            return False
        pack = Pack(name, sum(len(memoryview(b).cast("B")) for b in buffers), table, mine=True)
        with self._lock:
            dead = self._add_packs([(pack, table)], newest=True)
            self.stats["writes"] += len(pages)
            self.stats["write_bytes"] += pack.nbytes
        self._remove(dead)
        self._enforce_quota(keep=pack)
        return True

    def _writer_tag(self) -> str:
        """Temp names carry their writer (pid, its start time, thread) so the scan can tell
        a live writer's file from an orphan."""
        return f"{os.getpid()}.{self._start}.{threading.get_ident()}"

    def _write_file(self, tmp: Path, buffers: list) -> None:
        """Create ``tmp`` with the buffers' bytes; through O_DIRECT where the store takes it."""
        if not self.direct:
            fd = self.dirs.create_file(tmp)
            try:
                write_all(fd, buffers)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            return
        views = [memoryview(b).cast("B") for b in buffers]
        want = sum(len(v) for v in views)
        buf = self._aligned(want)
        at = 0
        for view in views:
            buf[at: at + len(view)] = view
            at += len(view)
        fd = self.dirs.create_file(tmp, os.O_DIRECT)
        try:
            with memoryview(buf) as whole:
                write_all(fd, [whole[: packfile.aligned(want)]])
            os.ftruncate(fd, want)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _sync_dir(self, directory: Path) -> None:
        if self.fsync:
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def submit_writes(self, items: Sequence[tuple[int, bytes, object]]) -> list[Future]:
        """Pages wait (at most ``PACK_LINGER_S``, or until ``flush``) to share a pack with the
        pages after them; pages over ``PACK_MAX_PAGE`` are written to files of their own."""
        futures, held, held_bytes = [], [], 0
        for group, key, payload in items:
            nbytes = memoryview(payload).nbytes
            if self.read_only or nbytes > PACK_MAX_PAGE:
                futures.append(self._io.submit(WRITE, self.write, group, key, payload))
            else:
                future: Future = Future()
                held.append((group, key, payload, future))
                futures.append(future)
                held_bytes += nbytes
        if held:
            with self._pending_ready:
                first = not self._pending
                self._pending += held
                self._pending_bytes += held_bytes
                self._pending_ready.notify_all()
            if first:
                self._io.submit(WRITE, self._write_pending)
        return futures

    def flush(self) -> None:
        """Write the held small pages now (a request ended: its pages are complete)."""
        with self._pending_ready:
            self._flush_asked = bool(self._pending)
            self._pending_ready.notify_all()

    def _write_pending(self) -> None:
        """Wait until the held pages fill a pack, a flush or the linger time, then write them
        as packs of at most ``PACK_BYTES`` (the first here, the rest on other I/O threads)."""
        deadline = time.monotonic() + PACK_LINGER_S
        with self._pending_ready:
            self._pending_ready.wait_for(
                lambda: self._pending_bytes >= PACK_BYTES or self._flush_asked or self._closing,
                timeout=max(0.0, deadline - time.monotonic()))
            held, self._pending, self._pending_bytes, self._flush_asked = self._pending, [], 0, False
        if not held:
            return
        packs, size = [[]], 0
        for item in held:
            if size >= PACK_BYTES:
                packs.append([])
                size = 0
            packs[-1].append(item)
            size += memoryview(item[2]).nbytes
        for pack in packs[1:]:
            self._io.submit(WRITE, self._write_held, pack)
        self._write_held(packs[0])

    def _write_held(self, held: list[tuple[int, bytes, object, Future]]) -> None:
        try:
            ok = self.write_pack([(g, k, p) for g, k, p, _ in held])
        except BaseException as e:          # whoever waits on a page hears of it
            for *_, future in held:
                future.set_exception(e)
            raise
        for *_, future in held:
            future.set_result(ok)

    def _enforce_quota(self, keep: bytes | Pack | None) -> None:
        """Evict from the LRU end down to the quota (a packed page takes its whole pack along);
        the file just written stays, even alone over quota. Not before the scan has ordered
        the store, and never in a read-only store: its files cannot go, so its index keeps
        every page that is there."""
        if self.max_bytes is None or self._gone is not None or self.read_only:
            return
        victims, kept, evicted = [], None, 0
        with self._lock:               # O(evicted) per write: the LRU end of the order, no scan
            while self._bytes > self.max_bytes and self._idle:
                victims += self._bury(self._idle.pop(next(iter(self._idle))), gone=True)
            while self._bytes > self.max_bytes and self._lru:
                victim = next(iter(self._lru))
                if victim is keep or victim == keep:
                    kept = (victim, self._lru.pop(victim))
                elif isinstance(victim, Pack):
                    evicted += victim.live
                    victims += self._drop_pack(victim)
                else:
                    evicted += 1
                    self._drop_file(victim)
                    victims.append(page_file(self._namespace_str, *_group_key(victim)))
            if kept is not None:
                self._lru[kept[0]] = kept[1]
            self.stats["evictions"] += evicted
        for path in victims:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

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
            self._drop_file(ident)
            if self._gone is not None:
                self._gone.add(ident)

    def _forget_pack(self, pack: Pack) -> None:
        """A pack is gone or damaged: none of its pages is served from it again."""
        with self._lock:
            self._drop_pack(pack)               # its file is gone or in quarantine already

    def close(self) -> None:
        """Write the held pages and drain queued writes: a clean exit loses nothing acknowledged."""
        self._closing = True
        with self._pending_ready:
            self._pending_ready.notify_all()
        self._scanner.join()
        self._io.close()


def _by_group(groups: list[int]) -> dict[int, list[int]]:
    """Positions in ``groups`` by group: lookups go to one table per group."""
    if groups and groups.count(groups[0]) == len(groups):     # the usual batch: one group
        return {groups[0]: list(range(len(groups)))}
    positions: dict[int, list[int]] = {}
    for n, group in enumerate(groups):
        positions.setdefault(group, []).append(n)
    return positions


def _groups_of(groups: np.ndarray) -> list[int]:
    """The distinct groups in ``groups``, counted: a process's first plain ``np.unique``
    costs ~10 ms, which the first lookup after a start would wait for."""
    return np.flatnonzero(np.bincount(groups)).tolist()


def _touch(paths: list[str]) -> None:
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


register_tier("fs", "store", lambda root, layout, config: FilesystemTier(
    root, layout, config.fs_bytes, config.durability, mode=config.store_mode))
