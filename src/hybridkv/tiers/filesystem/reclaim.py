"""Giving back disk the store no longer serves from: dead and mostly-dead packs, old namespaces.

A page stored again lands in a new pack and leaves its old one, so after a restart or a write
storm most packs can serve nothing; only a quota would ever remove them, and only under
pressure. A reclaim pass removes packs that serve no page, compacts packs that serve less than
``COMPACT_BELOW`` of their bytes (their live pages, verified, go to a new pack; then the old one
goes) and, under a quota, removes whole namespaces of other fingerprints (an upgrade of the
model, vLLM or hybridkv leaves one behind) least recently used first.

Crash-safe: a compacted pack's pages are renamed into place in a new pack before the old one is
unlinked, and a restart serves the newest copy of a page. A pack or namespace used in the last
grace period (written, or read: every read refreshes mtimes) is left alone, as another engine
may be serving from it; taking one from under it would cost it a miss, never a wrong page.
Passes run on the tier's I/O threads, one at a time: after the start-up scan and whenever
``RECLAIM_EVERY_BYTES`` more were written.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time

import numpy as np

from hybridkv.tiers.filesystem.index import Pack
from hybridkv.tiers.filesystem.paths import regular_stat
from hybridkv.tiers.io_queue import WRITE

log = logging.getLogger(__name__)

RECLAIM_GRACE_S = 60.0          # a pack used this recently is left alone
NAMESPACE_IDLE_S = 600.0        # and another namespace used this recently
COMPACT_BELOW = 0.5             # a pack serving less than this share of its bytes is compacted
RECLAIM_EVERY_BYTES = 256 << 20


class ReclaimMixin:
    """Reclaim passes of ``FilesystemTier`` (state set up by its ``__init__``)."""

    def _wrote(self, nbytes: int) -> None:
        """Count bytes written; start a pass in the background once enough accumulated."""
        with self.index.lock:
            self._since_reclaim += nbytes
            if self._since_reclaim < RECLAIM_EVERY_BYTES:
                return
        self._start_reclaim()

    def _start_reclaim(self) -> None:
        with self.index.lock:
            if self._reclaiming or self.read_only or self._closing:
                return
            self._reclaiming, self._since_reclaim = True, 0
        try:
            self._io.submit(WRITE, self._reclaim_job)
        except RuntimeError:              # closing
            self._reclaiming = False

    def _reclaim_job(self) -> None:
        try:
            self.reclaim()
        except Exception:                 # the next pass tries again; nothing served changed
            log.exception("filesystem tier %s: reclaiming disk failed", self.namespace)
        finally:
            self._reclaiming = False

    def reclaim(self, grace_s: float = RECLAIM_GRACE_S, namespace_idle_s: float = NAMESPACE_IDLE_S) -> dict:
        """One pass on this thread, after any pass running in the background: remove dead
        packs, compact mostly-dead ones, and under a quota remove other namespaces. Returns
        what this pass did (``stats`` counts every pass's)."""
        with self._reclaim_lock:
            return self._reclaim_pass(grace_s, namespace_idle_s)

    def _reclaim_pass(self, grace_s: float, namespace_idle_s: float) -> dict:
        done = {"dead_packs": 0, "compacted_packs": 0, "freed_bytes": 0, "namespaces_removed": 0}
        if self.read_only or not self.scanned.is_set():
            return done
        cutoff = time.time() - grace_s
        with self.index.lock:   # by count first (O(1) a pack): a lookup never waits on a probe of every pack
            idle = list(self.index.idle.values())
            fewer = [p for p in self.index.packs.values() if 0 < p.live < COMPACT_BELOW * len(p.groups)]
        sparse = []
        for pack in fewer:
            with self.index.lock:
                if pack.live and self.index.live_bytes(pack) < COMPACT_BELOW * pack.nbytes:
                    sparse.append(pack)
        for pack in idle:
            if not self._closing and not self._used_since(pack, cutoff):
                with self.index.lock:
                    paths = self.index.bury(pack, gone=True) if self.index.idle.get(pack.name) is pack else []
                self._remove(paths)
                done["dead_packs"] += len(paths)
                done["freed_bytes"] += pack.nbytes if paths else 0
        for pack in sparse:
            if not self._closing and not self._used_since(pack, cutoff) and self._compact(pack):
                done["compacted_packs"] += 1
                done["freed_bytes"] += pack.nbytes
        if self.max_bytes is not None:
            done["namespaces_removed"] = self._collect_namespaces(time.time() - namespace_idle_s)
        with self.index.lock:
            for name, count in done.items():
                self.stats[f"reclaimed_{name}"] += count
        return done

    def _used_since(self, pack: Pack, cutoff: float) -> bool:
        st = regular_stat(f"{self._packs_dir}/{pack.name}")
        return st is not None and st.st_mtime >= cutoff

    def _compact(self, pack: Pack) -> bool:
        """Move a pack's live pages, verified, into a new pack; then the old one goes."""
        found = self._open_pack(pack.name)     # its table: the index keeps no keys, only fingerprints
        if found is None:
            return False
        table = found[1]
        with self.index.lock:
            entries = self.index.live_entries(pack)
        if len(entries):
            pages = [(int(table["group"][e]), bytes(table["key"][e][: table["key_len"][e]]),
                      np.empty(int(table["length"][e]), np.uint8)) for e in entries.tolist()]
            reads = sorted(zip(entries.tolist(), pages, strict=True), key=lambda p: pack.offsets[p[0]])
            if not all(self.read_run(pack, reads)) or not self.write_pack(pages):
                return False
        with self.index.lock:                    # its pages serve from the new pack now
            paths = self.index.bury(pack, gone=True) if not pack.live else []
            gone = self.index.packs.get(pack.name) is not pack
        self._remove(paths)
        return gone

    def _collect_namespaces(self, idle_before: float) -> int:
        """Count other namespaces against the quota; remove the least recently used of those
        idle since ``idle_before`` until the store fits. Returns how many went."""
        from hybridkv.tiers import admin

        others = []
        dirs, namespaces = admin.open_store(self.root)
        for ns, _ in namespaces:
            if ns != self.namespace:
                files = list(admin.namespace_files(ns, dirs))
                others.append((admin.last_used(ns, files), sum(st.st_size for _, st in files), ns))
        others.sort()
        total = self.index.bytes + sum(nbytes for _, nbytes, _ in others)
        removed = 0
        for used, nbytes, ns in others:
            if total <= self.max_bytes or used >= idle_before:
                break
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(ns)            # open_store checked it: a directory of the store's own
            log.info("filesystem tier: removed namespace %s (unused since %s) to fit the quota",
                     ns.name, time.strftime("%Y-%m-%d %H:%M", time.localtime(used)))
            total -= nbytes
            removed += 1
        with self.index.lock:
            self._others_bytes = total - self.index.bytes
        return removed
