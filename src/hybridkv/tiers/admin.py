"""Offline care of a filesystem store: ``inspect``, ``verify`` and ``gc``, of page files and packs.

These work on any store directory without knowing the model: namespaces are found by
their manifest, groups and keys by their paths, and every page checks itself. They apply
the engine's rules for who may have written a store (``store_dirs``), with the store's mode
read from its root, and never follow a symlink out of it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hybridkv.tiers import packfile, pagefile
from hybridkv.tiers.filesystem import (
    MANIFEST,
    PACKS,
    QUARANTINE,
    open_page,
    quarantine,
    regular_stat,
)
from hybridkv.tiers.store_dirs import StoreDirs, existing_store_mode


def progress_bar(total: int, label: str, enabled: bool = True) -> tqdm:
    """A progress bar on a terminal; silent otherwise (and in --json mode)."""
    return tqdm(total=total, desc=label, unit="page", disable=None if enabled else True, leave=False)


def _is_dir(path: Path) -> bool:
    return stat.S_ISDIR(path.lstat().st_mode)


def open_store(store: str | Path) -> tuple[StoreDirs, list[tuple[Path, dict]]]:
    """The store's directory rules and its namespaces (with their manifests), checked."""
    store = Path(store).absolute()
    dirs = StoreDirs(store, existing_store_mode(store))
    dirs.check(store)
    found = []
    for ns in sorted(store.iterdir()):
        if not _is_dir(ns) or not os.path.lexists(ns / MANIFEST):
            continue
        dirs.check(ns)
        try:
            fd = open_page(ns / MANIFEST, os.O_RDONLY)
            with os.fdopen(fd) as f:
                found.append((ns, json.load(f)))
        except (OSError, ValueError, pagefile.CorruptPage):
            found.append((ns, {}))
    return dirs, found


def _pages(namespace: Path, dirs: StoreDirs) -> Iterator[tuple[int, Path, os.stat_result]]:
    """Regular page files with their own stat, in checked directories; a symlink or directory
    named ``*.blk`` is not a page, and following it could read or delete outside the store."""
    for gdir in sorted(namespace.glob("g*")):
        try:
            group = int(gdir.name[1:])
        except ValueError:
            continue
        dirs.check(gdir)                 # a link or foreign directory is refused, as at open
        for sub in gdir.iterdir():
            dirs.check(sub)
        for path in gdir.glob("*/*.blk"):
            st = regular_stat(path)
            if st is not None:
                yield group, path, st


def _packs(namespace: Path, dirs: StoreDirs) -> Iterator[tuple[Path, os.stat_result]]:
    """Regular pack files with their own stat, in the checked packs directory."""
    pdir = namespace / PACKS
    if not os.path.lexists(pdir):
        return
    dirs.check(pdir)
    for path in sorted(pdir.glob(f"*{packfile.SUFFIX}")):
        st = regular_stat(path)
        if st is not None:
            yield path, st


def _read_pack(path: Path) -> tuple[bytes, np.ndarray]:
    with os.fdopen(open_page(path, os.O_RDONLY), "rb") as f:
        blob = f.read()
    return blob, packfile.parse_table(blob, len(blob))


def namespace_files(namespace: Path, dirs: StoreDirs) -> Iterator[tuple[Path, os.stat_result]]:
    """Every page file and pack file: the units the store removes."""
    for _, path, st in _pages(namespace, dirs):
        yield path, st
    yield from _packs(namespace, dirs)


def _group_record(groups: dict[int, dict], kinds: dict[int, str], group: int) -> dict:
    return groups.setdefault(group, {"id": group, "kind": kinds.get(group, "unknown"), "files": 0, "bytes": 0})


def inspect_store(store: str | Path) -> dict:
    dirs, namespaces = open_store(store)
    out = {"total_bytes": 0, "namespaces": []}
    for ns, manifest in namespaces:
        kinds = {g["id"]: g["kind"] for g in manifest.get("layout", {}).get("groups", [])}
        groups: dict[int, dict] = {}
        for group, _, st in _pages(ns, dirs):
            g = _group_record(groups, kinds, group)
            g["files"] += 1
            g["bytes"] += st.st_size
        packs = {"files": 0, "bytes": 0, "pages": 0, "live_bytes": 0, "dead_bytes": 0}
        filed = {(group, bytes.fromhex(path.stem)) for group, path, _ in _pages(ns, dirs)}
        seen: set = set()                    # a page's newest pack serves it, a page file before any
        for path, st in sorted(_packs(ns, dirs), key=lambda found: -found[1].st_mtime_ns):
            packs["files"] += 1
            packs["bytes"] += st.st_size
            try:
                fd = open_page(path, os.O_RDONLY)
                try:
                    table = packfile.read_table(fd)   # the table, not the pages
                finally:
                    os.close(fd)
            except (OSError, pagefile.CorruptPage):
                continue                     # verify reports and quarantines it
            packs["pages"] += len(table)
            for group, count in zip(*np.unique(table["group"], return_counts=True), strict=True):
                g = _group_record(groups, kinds, int(group))
                g["packed_pages"] = g.get("packed_pages", 0) + int(count)
            for row in table:
                page = (int(row["group"]), bytes(row["key"][: row["key_len"]]))
                live = page not in filed and page not in seen
                seen.add(page)
                packs["live_bytes" if live else "dead_bytes"] += int(packfile.aligned(int(row["length"])))
        qdir = ns / QUARANTINE
        quarantined = sum(1 for _ in qdir.iterdir()) if os.path.lexists(qdir) and _is_dir(qdir) else 0
        total = sum(g["bytes"] for g in groups.values()) + packs["bytes"]
        out["total_bytes"] += total
        out["namespaces"].append({
            "fingerprint": ns.name, "model": manifest.get("model"), "total_bytes": total,
            "groups": [groups[k] for k in sorted(groups)], "packs": packs, "quarantined": quarantined,
            "last_used": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(last_used(ns, namespace_files(ns, dirs)))),
        })
    return out


def verify_store(store: str | Path, progress: bool = True) -> dict:
    """Check every page file and pack (each of its pages). Only a checksum or format failure
    is corruption, and only corrupt files are quarantined. A file removed between the listing
    and its read (an engine's eviction, a ``gc``: both are safe beside ``verify``) has
    vanished; one that cannot be read (EIO, EACCES) is unreadable and stays where it is."""
    dirs, namespaces = open_store(store)
    files = [(ns, g, p) for ns, _ in namespaces for g, p, _ in _pages(ns, dirs)]
    files += [(ns, None, p) for ns, _ in namespaces for p, _ in _packs(ns, dirs)]
    result = {"checked": 0, "ok": 0, "corrupt": 0, "quarantined": 0, "vanished": 0, "unreadable": 0}
    with progress_bar(len(files), "verifying", progress) as bar:
        for ns, group, path in files:
            result["checked"] += 1
            try:
                if group is None:
                    _verify_pack(path)
                else:
                    with os.fdopen(open_page(path, os.O_RDONLY), "rb") as f:
                        pagefile.decode(f.read(), group, bytes.fromhex(path.stem))
                result["ok"] += 1
            except FileNotFoundError:
                result["vanished"] += 1
            except OSError:
                result["unreadable"] += 1
            except (ValueError, pagefile.CorruptPage):
                result["corrupt"] += 1
                result["quarantined"] += quarantine(ns, path, dirs)
            bar.update()
    return result


def _verify_pack(path: Path) -> None:
    """Raise CorruptPage unless the pack's table and every page in it verify."""
    blob, table = _read_pack(path)
    view = memoryview(blob)                  # slices of it check the pages without copying them
    for offset, length, checksum in zip(*(table[f].tolist() for f in ("offset", "length", "checksum")), strict=True):
        if pagefile.checksum(view[offset: offset + length]) != checksum:
            raise pagefile.CorruptPage(f"payload checksum mismatch at offset {offset}")


def last_used(namespace: Path, files) -> float:
    """When a namespace was last written or read (engines refresh a page's mtime when they
    use it): its newest file (``files``: its ``_files``), or its manifest when it holds none."""
    return max((st.st_mtime for _, st in files), default=(namespace / MANIFEST).lstat().st_mtime)


def gc_store(store: str | Path, max_bytes: int | None = None, unused_days: float | None = None,
             progress: bool = True) -> dict:
    """Remove whole namespaces unused for ``unused_days`` (each upgrade of the model, vLLM or
    hybridkv starts a new one and leaves the old behind), then the least recently used files
    (page files and packs, by mtime, in every namespace: old namespaces' files go first) until
    the store fits ``max_bytes``."""
    dirs, namespaces = open_store(store)
    listed = {ns: list(namespace_files(ns, dirs)) for ns, _ in namespaces}
    removed_namespaces, freed_namespaces = [], 0
    if unused_days is not None:
        cutoff = time.time() - unused_days * 86400
        for ns in [ns for ns, found in listed.items() if last_used(ns, found) < cutoff]:
            freed_namespaces += sum(st.st_size for _, st in listed.pop(ns))
            shutil.rmtree(ns)               # checked by open_store: a directory of the store's own
            removed_namespaces.append(ns.name)
    files = [(st.st_mtime_ns, st.st_size, path) for found in listed.values() for path, st in found]
    files.sort()
    total = sum(size for _, size, _ in files)
    max_bytes = total if max_bytes is None else max_bytes
    removed, freed = 0, freed_namespaces
    with progress_bar(len(files), "collecting", progress) as bar:
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
            bar.update()
    return {"removed_namespaces": removed_namespaces, "removed_files": removed, "freed_bytes": freed,
            "total_bytes": total}
