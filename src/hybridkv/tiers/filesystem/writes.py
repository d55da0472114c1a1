"""The filesystem tier's writes: small pages held briefly and written together as a pack,
large ones as page files; every file under a temp name renamed into place, so no reader sees
a partial page, also across processes and after ``kill -9``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

from hybridkv.core.errors import HybridKVError
from hybridkv.tiers import packfile, pagefile
from hybridkv.tiers.filesystem.index import Pack
from hybridkv.tiers.filesystem.paths import page_ident, page_path, write_all
from hybridkv.tiers.io_queue import WRITE

log = logging.getLogger(__name__)

PACK_MAX_PAGE = 16 << 20    # pages up to this size are packed (a 10 MiB page read 0.78x raw from its own file, 1.1x packed)
PACK_BYTES = 8 << 20        # a pack is written once its pages reach this size,
PACK_LINGER_S = 1.0         # or this long after its first page, or at a flush (a request ended)


class WriteMixin:
    """Writes of ``FilesystemTier`` (state set up by its ``__init__``)."""

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
        ident = page_ident(group, key)
        with self.index.lock:
            self._bad.discard(ident)
            dead = self.index.put_file(ident, self.index.size(size))
            self.stats["writes"] += 1
            self.stats["write_bytes"] += size
        self._remove(dead)
        self._enforce_quota(keep=ident)
        self._wrote(size)
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
        with self.index.lock:
            dead = self.index.add_packs([(pack, table)], newest=True)
            self.stats["writes"] += len(pages)
            self.stats["write_bytes"] += pack.nbytes
        self._remove(dead)
        self._enforce_quota(keep=pack)
        self._wrote(pack.nbytes)
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

    def _write_failed(self, path: Path, error: OSError | HybridKVError) -> None:
        """One log line per kind of failure, not one per page; a store gone read-only stays so."""
        with self.index.lock:
            self.stats["write_errors"] += 1
            code = getattr(error, "errno", None)
            first = code not in self._write_errnos
            self._write_errnos.add(code)
            if code in (errno.EROFS, errno.EACCES, errno.EPERM):
                self.read_only = True
        if first:
            log.warning("filesystem tier could not write %s: %s (further such failures are counted "
                        "in stats, not logged)", path, error)
