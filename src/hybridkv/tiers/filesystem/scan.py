"""The filesystem tier's start-up scan and its discovery of pages other processes wrote.

The scan runs in the background so a store of a million pages opens at once: first the pack
tables (their pages serve from then on), then the page files, ordered by mtime. A lookup the
index misses queues its keys for discovery, which stats their files and lists new packs off
the lookup path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from array import array
from collections import OrderedDict
from pathlib import Path

import numpy as np

from hybridkv.tiers import packfile, pagefile
from hybridkv.tiers.filesystem.index import FoundPack, Pack
from hybridkv.tiers.filesystem.paths import (
    PAGE_SUFFIX,
    open_page,
    page_file,
    page_ident,
    quarantine,
    regular_size,
    split_ident,
    tmp_owner_alive,
)
from hybridkv.tiers.io_queue import WRITE

log = logging.getLogger(__name__)

PACK_RELIST_S = 0.1         # misses relist a packs directory others write to at most this often
DISCOVER_KEYS = 4096        # keys the lookups' background discovery holds at most (more: later misses)
YIELD_EVERY = 512           # entries the scan handles between handing the GIL to lookups (~0.3 ms)
PROBE_SLICE = 16384         # files probed against the pack tables per hold of the index lock


class ScanMixin:
    """Start-up scan and discovery of ``FilesystemTier`` (state set up by its ``__init__``)."""

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
            with self.index.lock:
                self.index.gone = self.index.fresh = None
        self.packs_indexed.set()
        if not self._closing:
            self._enforce_quota(keep=None)
            self.scanned.set()
            self._start_reclaim()

    def _index_packs(self) -> list[tuple[Pack, int]]:
        """First the packs (one table read each, few files): their pages are served from
        then on, while the page files are still being walked. Of a page in several packs,
        the newest pack's copy serves. Returns the packs and their mtimes (the tables,
        55 B a page, are not kept)."""
        packed = self._scan_packs()
        packed.sort(key=lambda found: found[2])
        with self.index.lock:     # not those written or evicted here since the listing
            self.index.add_packs([(pack, table) for pack, table, _ in reversed(packed)
                                  if pack.name not in self.index.packs
                                  and self.index.pack_file(pack.name) not in self.index.removed],
                                 newest=False, fresh=False)
            for pack, _, _ in reversed(packed):     # by mtime, before what was used meanwhile
                if pack in self.index.lru:
                    self.index.lru.move_to_end(pack, last=False)
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
                        for n, entry in enumerate(entries, 1):
                            self._scan_entry(entry, group, mtimes, idents, sizes)
                            if n % YIELD_EVERY == 0:
                                time.sleep(0)     # hand the GIL to a waiting lookup
                except OSError:
                    continue
        # Ordering a million entries takes a few hundred ms: it runs outside the lock, on a
        # snapshot, in slices that hand the GIL to lookups between them, and only what changed
        # meanwhile is reconciled under the lock, so a lookup (on the engine's scheduler
        # thread) waits for neither.
        with self.index.lock:
            gone, known, fresh = set(self.index.gone), set(self.index.lru), set(self.index.fresh)
        skip: set[int] = set()                # files whose page a pack holds: it serves
        for lo in range(0, len(idents), PROBE_SLICE):
            with self.index.lock:
                skip.update(lo + n for n in self.index.packed_among(idents[lo:lo + PROBE_SLICE]))
            time.sleep(0)
        stamps, keys, values = [], [], []
        n_bytes = 0
        for n, ident in enumerate(idents):  # not those dropped or indexed meanwhile
            if n not in skip and ident not in gone and ident not in known:
                stamps.append(mtimes[n])
                keys.append(ident)
                values.append(sizes[n])
                n_bytes += sizes[n]
            if n % YIELD_EVERY == 0:
                time.sleep(0)
        n_files = len(keys)
        for pack, mtime in packed:
            if pack in known and pack not in fresh:
                stamps.append(mtime)
                keys.append(pack)
                values.append(pack.nbytes)
        order = np.argsort(np.array(stamps, np.int64), kind="stable").tolist()
        ordered: OrderedDict = OrderedDict()
        for lo in range(0, len(order), YIELD_EVERY):
            ordered.update((keys[i], values[i]) for i in order[lo:lo + YIELD_EVERY])
            time.sleep(0)
        with self.index.lock:
            # dropped since the snapshot; indexed, used or unpacked since (the latter go last)
            changed = (self.index.gone - gone) | (self.index.fresh - fresh) | (self.index.lru.keys() ^ known)
            skip_idents = [idents[n] for n in skip]
            if any(isinstance(key, Pack) for key in self.index.lru.keys() - known):
                # a pack written meanwhile may hold a scanned file's page: its copy serves
                scanned = [key for key in ordered if not isinstance(key, Pack)]
                now_packed = [scanned[n] for n in self.index.packed_among(scanned)]
                changed |= set(now_packed)
                skip_idents += now_packed
            for key in changed:
                size = ordered.pop(key, None)
                if size is not None and not isinstance(key, Pack):
                    n_files, n_bytes = n_files - 1, n_bytes - size
            self.index.files += n_files
            self.index.bytes += n_bytes
            for key, value in self.index.lru.items():   # used since start-up: the most recent
                ordered.setdefault(key, value)
            self.index.lru, self.index.gone, self.index.fresh = ordered, None, None
            # a file is stale only if its page is still packed and not indexed as a file now
            still = [skip_idents[n] for n in self.index.packed_among(skip_idents)]
            dead = [self.index.removing(page_file(self._namespace_str, *split_ident(i)))
                    for i in still if i not in self.index.lru]
        self._remove(dead)

    def _scan_entry(self, entry: os.DirEntry, group: int, mtimes, idents, sizes) -> None:
        name = entry.name
        if self._reclaim_temp(entry):
            return
        if not name.endswith(PAGE_SUFFIX):
            return
        try:
            st = entry.stat(follow_symlinks=False)
            key = bytes.fromhex(name[:-4])
        except (OSError, ValueError):
            return
        if stat.S_ISREG(st.st_mode):
            mtimes.append(st.st_mtime_ns)
            idents.append(page_ident(group, key))
            sizes.append(self.index.size(st.st_size))

    def _reclaim_temp(self, entry: os.DirEntry) -> bool:
        """Is this a temp file? One whose writer is gone is removed."""
        if not entry.name.endswith(".tmp"):
            return False
        if not self.read_only and not tmp_owner_alive(entry.name):
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
        with self.index.lock:
            self.stats["corrupt"] += 1
        return moved

    def wait_scanned(self, timeout: float | None = None) -> bool:
        """Block until the start-up scan has indexed the store (tools, tests)."""
        return self.scanned.wait(timeout)

    def wait_ready(self, timeout: float) -> bool:
        """The scan reads the pack tables first: milliseconds for most stores, about a second
        for a million packed pages. Engines wait for that part once, at start-up; if it takes
        longer, the pages of the packs not read yet are misses until it has (said once)."""
        if self.packs_indexed.wait(timeout):
            return True
        log.warning("filesystem tier %s: the pack tables are still being read after %.0f s; "
                    "their pages are misses until then", self.namespace, timeout)
        return False

    def _discover(self, idents: list[bytes]) -> None:
        """Look for pages lookups missed off the lookup path: an I/O thread stats their files
        and lists new packs, one job at a time; the lookup that missed recomputes."""
        with self.index.lock:
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
        with self.index.lock:
            self._undiscovered.clear()
            self._discovered.set()

    def _discover_job(self) -> None:
        try:
            while True:
                with self.index.lock:          # taking the keys and going idle are one step
                    idents, self._undiscovered = self._undiscovered, set()
                    if not idents or self._closing:
                        self._discovered.set()
                        return
                    self.stats["disk_lookups"] += len(idents)
                    self._forget_removed()
                paths = {ident: page_file(self._namespace_str, *split_ident(ident)) for ident in idents}
                on_disk = {ident: size for ident, path in paths.items() if (size := regular_size(path)) is not None}
                dead = []
                with self.index.lock:     # not a file this process evicted meanwhile (it is going)
                    for ident, size in on_disk.items():
                        group, key = split_ident(ident)
                        if (self.index.locate(group, [key])[0] is None and paths[ident] not in self.index.removed
                                and ident not in self._bad):
                            dead += self.index.put_file(ident, self.index.size(size))
                self._remove(dead)
                self._list_new_packs()
        except Exception:                 # the next miss starts a fresh job
            log.exception("filesystem tier %s: looking for pages other processes wrote failed", self.namespace)
            self._idle_discovery()

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
            with self.index.lock:
                self._forget_removed()
            names = [e.name for e in os.scandir(self._packs_dir) if e.name.endswith(packfile.SUFFIX)]
        except OSError:
            return
        self._packs_listed, self._packs_listed_at = listed, now
        with self.index.lock:
            self.stats["pack_listings"] += 1
        for name in names:
            if self._closing:
                return
            path = self.index.pack_file(name)
            if name in self.index.packs or name in self._bad_packs or path in self.index.removed:
                continue
            found = self._open_pack(name)
            if found is not None:
                pack, table, _ = found
                with self.index.lock:     # not one this process evicted meanwhile (its file is going)
                    if name not in self.index.packs and path not in self.index.removed:
                        self.index.add_packs([(pack, table)], newest=False)
