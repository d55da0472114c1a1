"""Shared RAM regions: one ``slots x page`` file per group, mapped MAP_SHARED.

A region lives under ``/dev/shm`` by default so other processes (tensor-parallel workers)
attach by path and see the same bytes. Its owner holds an flock on a lease file for as long
as it lives; the kernel drops the lock when the owner dies, however it dies, so a later start
removes the regions of killed owners and never a live owner's. A lock, unlike a PID, means
the same thing in every container that shares the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hybridkv.core.errors import HybridKVError


class PinningFailed(HybridKVError):
    """A pin hook failed for good: fatal where it runs (never a silent fallback)."""


# Runs once per process that maps a region (e.g. CUDA host registration); what it returns, if
# anything, undoes it and runs before the mapping goes.
PinHook = Callable[["SharedRegion"], "Callable[[], None] | None"]


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (None if it is not running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _lease_path(path: Path) -> Path:
    return path.with_name(path.name + ".lease")


def _hold_lease(path: Path) -> int:
    """Write the lease under a temp name, lock it, then publish it: no one ever sees this
    owner's lease unlocked. The pid inside is for people reading it, not for liveness."""
    lease = _lease_path(path)
    fd, tmp = tempfile.mkstemp(dir=lease.parent, prefix=".lease-")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"pid": os.getpid(), "region": path.name}).encode())
        os.replace(tmp, lease)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


class SharedRegion:
    """``slots`` pages of ``page_bytes`` each in one shared mapping."""

    def __init__(self, path: Path, slots: int, page_bytes: int, fd: int, owner: bool):
        self.path, self.slots, self.page_bytes = path, slots, page_bytes
        self._fd = fd
        self._map = mmap.mmap(fd, slots * page_bytes, mmap.MAP_SHARED)
        self.array = np.frombuffer(self._map, dtype=np.uint8).reshape(slots, page_bytes)
        self._unlinker = None
        self._unpin: Callable[[], None] | None = None
        if owner:
            self.take_ownership()

    @property
    def nbytes(self) -> int:
        return self.slots * self.page_bytes

    @classmethod
    def create(cls, path: str | Path, slots: int, page_bytes: int,
               pin_hook: PinHook | None = None, rank: int = 0) -> SharedRegion:
        """Create exclusively and become the owner; partial failure removes what was made."""
        path = Path(path)
        size = slots * page_bytes
        try:
            st = os.statvfs(path.parent)
        except OSError as e:
            raise HybridKVError(f"RAM region directory {path.parent} is unusable: {e.strerror}") from None
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise HybridKVError(
                f"RAM region {path} needs {size} B but {path.parent} has {free} B free; "
                "lower ram_bytes or point ram_dir at a larger tmpfs"
            )
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        region = None
        try:
            os.fchmod(fd, 0o600)
            try:
                # Commit the space now: a sparse file on a tmpfs that fills up later would kill
                # the engine with SIGBUS at the first write into an uncommitted page.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise HybridKVError(
                    f"RAM region {path} needs {size} B that {path.parent} cannot provide "
                    f"({e.strerror}); lower ram_bytes or point ram_dir at a larger tmpfs") from None
            region = cls(path, slots, page_bytes, fd, owner=True)
            if pin_hook is not None:
                region.run_pin_hook(pin_hook, rank)
            return region
        except BaseException:
            if region is not None:
                region.close()
            else:
                os.close(fd)
                path.unlink(missing_ok=True)
            _lease_path(path).unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, path: str | Path, slots: int, page_bytes: int,
               pin_hook: PinHook | None = None, rank: int = 0) -> SharedRegion:
        """Map a region another process created; its size must match. ``pin_hook`` as in
        ``create``: a worker that copies to a GPU registers its own mapping."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise HybridKVError(f"cannot attach RAM region {path}: {e.strerror}") from None
        actual = os.fstat(fd).st_size
        if actual != slots * page_bytes:
            os.close(fd)
            raise HybridKVError(
                f"RAM region {path} has {actual} B, expected {slots * page_bytes}; "
                "the processes disagree on the layout or budget"
            )
        region = cls(path, slots, page_bytes, fd, owner=False)
        if pin_hook is not None:
            try:
                region.run_pin_hook(pin_hook, rank)
            except BaseException:
                region.close()
                raise
        return region

    def take_ownership(self) -> None:
        """This process will unlink the file at close, whoever created it. The files go at
        close, or by the finalizer when a region is never closed (forgotten cache, exception)."""
        if self._unlinker is None:
            self._unlinker = weakref.finalize(self, _unlink_region, self.path, _hold_lease(self.path))

    def run_pin_hook(self, hook: PinHook, rank: int = 0) -> None:
        """Run e.g. CUDA host registration under an exclusive flock; failure is fatal."""
        lock_fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            self._unpin = hook(self)
        except Exception as e:
            raise PinningFailed(
                f"pinning RAM region failed on rank {rank}: path {self.path}, size {self.nbytes} B: {e}"
            ) from e
        finally:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
            os.close(lock_fd)

    def page(self, slot: int) -> np.ndarray:
        """Zero-copy view of one slot."""
        return self.array[slot]

    def pages(self, first: int, count: int) -> np.ndarray:
        """Zero-copy view of ``count`` adjacent slots, one page a row."""
        return self.array[first:first + count]

    def write(self, slot: int, data) -> None:
        """Copy one page in (any C-contiguous buffer or array of at most ``page_bytes``)."""
        src = data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        np.copyto(self.array[slot, : src.size], src)

    def close(self) -> None:
        if self._map is None:
            return
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self.array = None
        with contextlib.suppress(BufferError):  # a view still alive keeps the mapping
            self._map.close()
        self._map = None
        os.close(self._fd)
        if self._unlinker is not None:
            self._unlinker()          # unlinks once; a no-op if it already ran


class PagelessRegion:
    """Slots without bytes, in place of a ``SharedRegion`` where only the bookkeeping counts:
    the simulator replays traffic against budgets of many GiB through the real cache."""

    EMPTY = np.empty(0, np.uint8)

    def __init__(self, slots: int, page_bytes: int):
        self.slots, self.page_bytes = slots, page_bytes

    def page(self, slot: int) -> np.ndarray:
        return self.EMPTY

    def pages(self, first: int, count: int) -> np.ndarray:
        return np.empty((count, 0), np.uint8)

    def write(self, slot: int, data) -> None:
        """Nothing to copy into."""

    def close(self) -> None:
        """Nothing to release."""


def _unlink_region(path: Path, lease_fd: int) -> None:
    path.unlink(missing_ok=True)
    _lease_path(path).unlink(missing_ok=True)
    os.close(lease_fd)               # the lock goes last


def remove_stale_regions(directory: str | Path, prefix: str = "hybridkv-") -> list[Path]:
    """Remove regions whose lease nobody holds locked; a live owner's stay."""
    removed = []
    for lease_file in Path(directory).glob(f"{prefix}*.lease"):
        try:
            fd = os.open(lease_file, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:              # held: its owner lives, in this container or another
            os.close(fd)
            continue
        try:
            region = lease_file.with_name(lease_file.name[: -len(".lease")])
            with contextlib.suppress(FileNotFoundError):
                region.unlink()
                removed.append(region)
            lease_file.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return removed
