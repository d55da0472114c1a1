"""The filesystem tier's reads: page files, and runs of adjacent packed pages read in one
request straight into the RAM slots. Every page is verified; a bad one is quarantined and
never served again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from hybridkv.tiers import packfile, pagefile
from hybridkv.tiers.base import ReadItem
from hybridkv.tiers.filesystem.index import Pack, by_group
from hybridkv.tiers.filesystem.paths import (
    ALIGN,
    check_size,
    open_page,
    page_file,
    page_ident,
    quarantine,
    touch_files,
)
from hybridkv.tiers.io_queue import READ, WRITE, fan_out

log = logging.getLogger(__name__)

RUN_BYTES = 4 << 20         # the largest read of adjacent packed pages in one request,
RUN_PAGES = 512             # and its most pages (a page and its padding: two of IOV_MAX 1024)


class ReadMixin:
    """Reads of ``FilesystemTier`` (state set up by its ``__init__``)."""

    def read(self, group: int, key: bytes, out: np.ndarray) -> bool:
        """Fill ``out`` (one page, uint8) from disk; False (and quarantine) if anything is off."""
        with self.index.lock:
            where = self.index.locate(group, [key])[0]
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
                with self.index.lock:
                    self._bad.add(page_ident(group, key))
            with self.index.lock:
                self.stats["corrupt"] += 1
            return False
        except OSError as e:
            # EMFILE, EIO, EINTR...: the page may be healthy, so it stays; this read misses.
            log.warning("cannot read page %s: %s", path, e)
            with self.index.lock:
                self.stats["read_errors"] += 1
            return False
        self._served([(group, key, out)])
        return True

    def _served(self, items: Sequence[ReadItem], pack: Pack | None = None) -> None:
        """Count one read request serving ``items`` and refresh their recency (their pack's:
        the quota removes a pack whole, so it ages as one)."""
        with self.index.lock:
            self.stats["read_requests"] += 1
            self.stats["reads"] += len(items)
            self.stats["read_bytes"] += sum(out.nbytes for _, _, out in items)
            used = ([pack] if items else []) if pack is not None else [page_ident(g, k) for g, k, _ in items]
            for key in used:
                if key in self.index.lru:
                    self.index.lru.move_to_end(key)
                    self.index.used(key)

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
            with self.index.lock:
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
                with self.index.lock:
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
                self._io.submit(WRITE, touch_files, paths)

    def _read_buffered(self, path: str, group: int, key: bytes, out: np.ndarray) -> None:
        header, spare = bytearray(pagefile.HEADER_BYTES), bytearray(1)
        fd = open_page(path, os.O_RDONLY)
        try:
            got = os.readv(fd, [header, out, spare])   # the spare byte catches a longer file
        finally:
            os.close(fd)
        check_size(got, pagefile.HEADER_BYTES + out.nbytes)
        pagefile.verify(bytes(header), out, group, key)

    def _read_direct(self, path: str, group: int, key: bytes, out: np.ndarray) -> None:
        want = pagefile.HEADER_BYTES + out.nbytes
        buf = self._aligned(want + 1)                 # room past the page catches a longer file
        fd = open_page(path, os.O_RDONLY | os.O_DIRECT)
        try:
            got = os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
        check_size(got, want)
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
        with self.index.lock:
            for group, at in by_group([group for group, _, _ in items]).items():
                keys = [items[n][1] for n in at]
                found = self.index.find_packed(group, keys)[1]
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
            table = np.frombuffer(self.index.numbered[int(numbers[lo])].offsets, np.uint64)
            offsets[lo:hi] = table[entries[lo:hi]]
        breaks = np.flatnonzero(new_pack | (offsets[1:] != offsets[:-1] + spans[:-1])) + 1
        ends = np.cumsum(spans)
        runs = []
        for lo, hi in zip([0, *breaks.tolist()], [*breaks.tolist(), len(locs)], strict=True):
            while lo < hi:        # greedy: as many pages as fit RUN_BYTES and RUN_PAGES, at least one
                last = int(np.searchsorted(ends, ends[lo] - spans[lo] + RUN_BYTES, "right"))
                stop = min(hi, lo + RUN_PAGES, max(last, lo + 1))
                runs.append((self.index.numbered[int(numbers[lo])], entries[lo:stop].tolist(),
                             positions[lo:stop].tolist()))
                lo = stop
        return runs
