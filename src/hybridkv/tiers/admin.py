"""Offline care of a filesystem store: ``inspect``, ``verify`` and ``gc``.

These work on any store directory without knowing the model: namespaces are found by
their manifest, groups and keys by their paths, and every page checks itself.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from hybridkv.core.errors import HybridKVError
from hybridkv.tiers import pagefile
from hybridkv.tiers.filesystem import MANIFEST, QUARANTINE, quarantine


class Progress:
    """A one-line progress bar on a terminal; silent otherwise (and in --json mode)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.enabled = enabled and sys.stderr.isatty() and total > 0

    def step(self, n: int = 1) -> None:
        self.done += n
        if self.enabled and (self.done == self.total or self.done % 64 == 0):
            width = 30
            filled = width * self.done // self.total
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _namespaces(store: Path) -> list[tuple[Path, dict]]:
    if not store.is_dir():
        raise HybridKVError(f"store directory {store} does not exist; check --store")
    found = []
    for manifest in sorted(store.glob(f"*/{MANIFEST}")):
        try:
            found.append((manifest.parent, json.loads(manifest.read_text())))
        except (OSError, ValueError):
            found.append((manifest.parent, {}))
    return found


def _pages(namespace: Path) -> Iterator[tuple[int, Path, os.stat_result]]:
    """Regular page files with their own stat; a symlink or directory named ``*.blk`` is not
    a page, and following it could read or delete outside the store."""
    for gdir in sorted(namespace.glob("g*")):
        try:
            group = int(gdir.name[1:])
        except ValueError:
            continue
        for path in gdir.glob("*/*.blk"):
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield group, path, st


def inspect_store(store: str | Path) -> dict:
    store = Path(store)
    out = {"total_bytes": 0, "namespaces": []}
    for ns, manifest in _namespaces(store):
        kinds = {g["id"]: g["kind"] for g in manifest.get("layout", {}).get("groups", [])}
        groups: dict[int, dict] = {}
        for group, _, st in _pages(ns):
            g = groups.setdefault(group, {"id": group, "kind": kinds.get(group, "unknown"),
                                          "files": 0, "bytes": 0})
            g["files"] += 1
            g["bytes"] += st.st_size
        qdir = ns / QUARANTINE
        quarantined = sum(1 for _ in qdir.iterdir()) if qdir.is_dir() else 0
        total = sum(g["bytes"] for g in groups.values())
        out["total_bytes"] += total
        out["namespaces"].append({
            "fingerprint": ns.name, "model": manifest.get("model"), "total_bytes": total,
            "groups": [groups[k] for k in sorted(groups)], "quarantined": quarantined,
        })
    return out


def verify_store(store: str | Path, progress: bool = True) -> dict:
    """Check every page file; corrupt ones are moved to quarantine."""
    pages = [(ns, g, p) for ns, _ in _namespaces(Path(store)) for g, p, _ in _pages(ns)]
    bar = Progress(len(pages), "verifying", progress)
    result = {"checked": 0, "ok": 0, "corrupt": 0, "quarantined": 0}
    for ns, group, path in pages:
        result["checked"] += 1
        try:
            blob = path.read_bytes()
            pagefile.decode(blob, group, bytes.fromhex(path.stem))
            result["ok"] += 1
        except (OSError, ValueError, pagefile.CorruptPage):
            result["corrupt"] += 1
            quarantine(ns, path)
            result["quarantined"] += 1
        bar.step()
    return result


def gc_store(store: str | Path, max_bytes: int, progress: bool = True) -> dict:
    """Remove least recently used page files (by mtime) until the store fits ``max_bytes``."""
    files = []
    for ns, _ in _namespaces(Path(store)):
        for _, path, st in _pages(ns):
            files.append((st.st_mtime_ns, st.st_size, path))
    files.sort()
    total = sum(size for _, size, _ in files)
    removed = freed = 0
    bar = Progress(max(0, len(files)), "collecting", progress)
    for _, size, path in files:
        if total <= max_bytes:
            break
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        total -= size
        freed += size
        removed += 1
        bar.step()
    return {"removed_files": removed, "freed_bytes": freed, "total_bytes": total}
