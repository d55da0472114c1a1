"""The filesystem tier's index of what its store holds, in memory; it does no I/O.

Packed pages sit in one ``PageTable`` per group (fingerprint -> pack number and entry), page
files in the recency order. The quota removes page files and whole packs, so the order holds
those: a page file's ident (value: its size) or a ``Pack`` (value: its size), least recent
first. A page is in a table or a file, not both. Methods return the paths of files no page
uses any more; the caller removes them, outside the lock. Callers hold ``lock``.
"""

from __future__ import annotations

import itertools
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from hybridkv.tiers import packfile, page_index
from hybridkv.tiers.filesystem.paths import pack_idents, page_file, page_ident, split_ident
from hybridkv.tiers.page_index import PageTable


class Pack:
    """A pack file as the index knows it: its size on disk; each page's group, fingerprint,
    offset and checksum (from the table, 34 B a page); how many of its pages are served from
    it (``live``); its number in the index's locations.

    A page stored again elsewhere leaves its old pack. A pack left with no page is removed at
    once if this process wrote it; one another process wrote may still serve that process,
    so it stays until the quota needs room, and goes first then."""

    __slots__ = ("name", "nbytes", "number", "groups", "fingerprints", "offsets", "checksums",
                 "spans", "live", "mine")

    def __init__(self, name: str, nbytes: int, table: np.ndarray, mine: bool = False):
        self.name, self.nbytes, self.number, self.live, self.mine = name, nbytes, -1, 0, mine
        self.groups = table["group"].astype(np.uint16)
        self.fingerprints = page_index.table_fingerprints(table["key"], table["key_len"])
        self.offsets = array("Q", table["offset"].astype(np.uint64).tobytes())
        self.checksums = array("Q", table["checksum"].astype(np.uint64).tobytes())
        self.spans = packfile.aligned(table["length"].astype(np.int64))   # bytes each page takes

    def locations(self, entries: np.ndarray) -> np.ndarray:
        """Index locations of entries of this pack: its number and the entry, in one int64."""
        return (self.number << 32) | entries.astype(np.int64)


def by_group(groups: list[int]) -> dict[int, list[int]]:
    """Positions in ``groups`` by group: lookups go to one table per group."""
    if groups and groups.count(groups[0]) == len(groups):     # the usual batch: one group
        return {groups[0]: list(range(len(groups)))}
    positions: dict[int, list[int]] = {}
    for n, group in enumerate(groups):
        positions.setdefault(group, []).append(n)
    return positions


def groups_of(groups: np.ndarray) -> list[int]:
    """The distinct groups in ``groups``, counted: a process's first plain ``np.unique``
    costs ~10 ms, which the first lookup after a start would wait for."""
    return np.flatnonzero(np.bincount(groups)).tolist()


# Where a page lies: the bytes of its page file, or a pack and the page's entry in its table.
Where = int | tuple[Pack, int]
# A pack found on disk: it, its table, its mtime.
FoundPack = tuple[Pack, np.ndarray, int]


class StoreIndex:
    def __init__(self, namespace: str, packs_dir: str):
        self.namespace_str, self.packs_dir = namespace, packs_dir
        self.lock = threading.Lock()
        self.tables: dict[int, PageTable] = {}
        self.lru: OrderedDict[bytes | Pack, int] = OrderedDict()
        self.files = 0                            # page files in lru
        self.bytes = 0
        self.packs: dict[str, Pack] = {}
        self.numbered: dict[int, Pack] = {}       # by Pack.number
        self.numbers = itertools.count()
        self.idle: dict[str, Pack] = {}           # packs serving no page here, oldest first
        self.sizes: dict[int, int] = {}           # one int object per distinct file size
        self.gone: set[bytes] | None = set()      # page files dropped while the scan runs; None after
        self.fresh: set[bytes | Pack] | None = set()   # lru keys used while it runs, not by it
        # files taken out of the index here for removal -> when they went (None: not yet). A
        # look for other processes' files (a listing of the packs, a stat of a page file) that
        # began before that may still see one: it must not index it again
        # (``forget_removed_before`` drops what no later look can see)
        self.removed: dict[str, float | None] = {}

    def pages(self) -> int:
        return self.files + sum(len(table) for table in self.tables.values())

    def used(self, key: bytes | Pack) -> None:
        """Note a use of a page file or pack while the scan runs: it outranks what the scan finds."""
        if self.fresh is not None:
            self.fresh.add(key)

    def size(self, nbytes: int) -> int:
        """The one int object for this size: a million index entries share a few."""
        return self.sizes.setdefault(nbytes, nbytes)

    def find_packed(self, group: int, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The keys' fingerprints and the location of each packed page (-1: not packed)."""
        fps, table = page_index.fingerprints(list(keys)), self.tables.get(group)
        return fps, table.find(fps) if table else np.full(len(keys), -1, np.int64)

    def locate(self, group: int, keys: Sequence[bytes]) -> list[Where | None]:
        """Where each page lies, as the index knows it."""
        wheres: list[Where | None] = []
        for key, loc in zip(keys, self.find_packed(group, keys)[1].tolist(), strict=True):
            if loc >= 0:
                wheres.append((self.numbered[loc >> 32], loc & 0xFFFFFFFF))
            else:
                wheres.append(self.lru.get(page_ident(group, key)) if self.files else None)
        return wheres

    def packed_among(self, idents: list[bytes]) -> list[int]:
        """Positions in ``idents`` of the pages a pack holds (callers hold self.lock)."""
        found = []
        for group, positions in by_group([split_ident(i)[0] for i in idents]).items():
            locs = self.find_packed(group, [idents[n][2:] for n in positions])[1]
            found += [positions[i] for i in np.flatnonzero(locs >= 0).tolist()]
        return found

    def put_file(self, ident: bytes, size: int) -> list[str]:
        """Index the newest copy of a page, in a page file (most recent); returns files no
        page uses now."""
        group, key = split_ident(ident)
        if self.removed:      # written again while an eviction of it is in flight: see _remove
            self.removed.pop(page_file(self.namespace_str, group, key), None)
        dead = self.unpack(group, [key])
        old = self.lru.pop(ident, None)
        self.files += old is None
        self.bytes += size - (old or 0)
        self.lru[ident] = size
        self.used(ident)
        return dead

    def drop_file(self, ident: bytes) -> None:
        size = self.lru.pop(ident, None)
        if size is not None:
            self.files -= 1
            self.bytes -= size

    def unpack(self, group: int, keys: list[bytes]) -> list[str]:
        """Unindex the packed copies of pages; returns files no page uses now."""
        fps, locs = self.find_packed(group, keys)
        held = locs >= 0
        if held.any():
            self.tables[group].remove(fps[held], locs[held])
        return self.release_packed(locs[held])

    def release_packed(self, locs: np.ndarray) -> list[str]:
        """Pages left these locations: their packs serve fewer; returns files none uses now."""
        dead = []
        numbers, counts = np.unique(locs >> 32, return_counts=True)
        for number, count in zip(numbers.tolist(), counts.tolist(), strict=True):
            pack = self.numbered[number]
            pack.live -= count
            dead += self.bury(pack)
        return dead

    def add_packs(self, found: list[tuple[Pack, np.ndarray]], newest: bool,
                   fresh: bool = True) -> list[str]:
        """Index packs' pages (most recent): all of them (``newest``: we just wrote the
        pack, its pages distinct) or those the index lacks, of a page in several packs the
        first pack's (another process wrote them; the scan passes the newest first).
        Returns files no page uses now."""
        for pack, _ in found:
            pack.number = next(self.numbers)
            self.numbered[pack.number] = pack
            self.packs[pack.name] = pack
            self.bytes += pack.nbytes
            self.lru[pack] = pack.nbytes
            if fresh:
                self.used(pack)
        dead = []
        for group in groups_of(np.concatenate([pack.groups for pack, _ in found])) if found else []:
            parts = [(pack, table, np.flatnonzero(pack.groups == group)) for pack, table in found]
            fps = np.concatenate([pack.fingerprints[entries] for pack, _, entries in parts])
            locs = np.concatenate([pack.locations(entries) for pack, _, entries in parts])
            owners = np.concatenate([np.full(len(entries), n) for n, (_, _, entries) in enumerate(parts)])
            if self.files:                     # pages held in page files too
                idents = [i for _, table, entries in parts for i in pack_idents(table[entries])]
                filed = np.array([ident in self.lru for ident in idents], bool)
                if newest:                      # the new copy serves: the file goes
                    for n in np.flatnonzero(filed).tolist():
                        self.drop_file(idents[n])
                        dead.append(self.removing(page_file(self.namespace_str, group, idents[n][2:])))
                else:                           # the page file serves, as before
                    fps, locs, owners = fps[~filed], locs[~filed], owners[~filed]
            table = self.tables.setdefault(group, PageTable())
            old, indexed = table.put(fps, locs, replace=newest)
            dead += self.release_packed(old[indexed & (old >= 0)])
            for n, count in enumerate(np.bincount(owners[indexed], minlength=len(parts)).tolist()):
                parts[n][0].live += count
        for pack, _ in found:
            dead += self.bury(pack)
        return dead

    def drop_pack(self, pack: Pack) -> list[str]:
        """Unindex every page of a pack and stop counting it; returns its path."""
        for group in groups_of(pack.groups):
            table = self.tables.get(group)
            if table is not None:
                entries = np.flatnonzero(pack.groups == group)
                table.remove(pack.fingerprints[entries], pack.locations(entries))
        pack.live = 0
        return self.bury(pack, gone=True)

    def bury(self, pack: Pack, gone: bool = False) -> list[str]:
        """A pack no page is served from: ours (or one ``gone`` already) stops counting and
        its path is returned for removal; another process's waits in ``_idle``."""
        if pack.live or self.packs.get(pack.name) is not pack:
            return []
        self.lru.pop(pack, None)
        if not (gone or pack.mine):
            self.idle[pack.name] = pack
            return []
        self.idle.pop(pack.name, None)
        del self.packs[pack.name]
        del self.numbered[pack.number]
        self.bytes -= pack.nbytes
        return [self.removing(self.pack_file(pack.name))]

    def pack_file(self, name: str) -> str:
        """A pack's path, as ``removed`` knows it."""
        return f"{self.packs_dir}/{name}"

    def removing(self, path: str) -> str:
        """``path`` leaves the index to be removed (``FilesystemTier._remove`` notes when it went)."""
        self.removed[path] = None
        return path

    def forget_removed_before(self, moment: float) -> None:
        """A look for other processes' files begins at ``moment``: files gone before it cannot be seen."""
        self.removed = {path: t for path, t in self.removed.items() if t is None or t >= moment}


    def evict_to(self, max_bytes: int, keep: bytes | Pack | None) -> tuple[list[str], int]:
        """Evict from the LRU end down to ``max_bytes`` (a packed page takes its whole pack
        along; idle packs go first); ``keep``, the file just written, stays even alone over
        it. Returns the paths to remove and how many pages were evicted."""
        victims, kept, evicted = [], None, 0
        while self.bytes > max_bytes and self.idle:
            victims += self.bury(self.idle.pop(next(iter(self.idle))), gone=True)
        while self.bytes > max_bytes and self.lru:
            victim = next(iter(self.lru))
            if victim is keep or victim == keep:
                kept = (victim, self.lru.pop(victim))
            elif isinstance(victim, Pack):
                evicted += victim.live
                victims += self.drop_pack(victim)
            else:
                evicted += 1
                self.drop_file(victim)
                victims.append(self.removing(page_file(self.namespace_str, *split_ident(victim))))
        if kept is not None:
            self.lru[kept[0]] = kept[1]
        return victims, evicted

    def check(self) -> list[str]:
        """Inconsistencies of the index with itself (empty when sound): every packed location
        names a pack that counts it, idle packs serve nothing, the file count and bytes add up."""
        problems, counted = [], {}
        for group, table in self.tables.items():
            fps, locs = table.entries()
            if not np.array_equal(table.find(fps), locs):
                problems.append(f"group {group}: a fingerprint does not find its own entry")
            for number in (locs >> 32).tolist():
                counted[number] = counted.get(number, 0) + 1
        live = {p.number: p.live for p in self.packs.values() if p.live}
        if counted != live:
            problems.append(f"packed pages per pack {counted} != the packs' live counts {live}")
        if any(p.live for p in self.idle.values()):
            problems.append("an idle pack still serves pages")
        files = [k for k in self.lru if isinstance(k, bytes)]
        if len(files) != self.files:
            problems.append(f"{len(files)} page files in the order, {self.files} counted")
        counted_bytes = sum(self.lru[k] for k in files) + sum(p.nbytes for p in self.packs.values())
        if counted_bytes != self.bytes:
            problems.append(f"{counted_bytes} bytes indexed, {self.bytes} counted")
        return problems

    def live_entries(self, pack: Pack) -> np.ndarray:
        """The entries of ``pack`` the index serves from it."""
        live = []
        for group in groups_of(pack.groups):
            table = self.tables.get(group)
            if table is not None:
                entries = np.flatnonzero(pack.groups == group)
                live.append(entries[table.find(pack.fingerprints[entries]) == pack.locations(entries)])
        return np.sort(np.concatenate(live)) if live else np.empty(0, np.int64)

    def live_bytes(self, pack: Pack) -> int:
        """Bytes of ``pack`` its served pages take (the rest is dead until the pack goes)."""
        return int(pack.spans[self.live_entries(pack)].sum()) if pack.live else 0
