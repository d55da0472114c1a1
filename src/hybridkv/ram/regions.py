"""Shared RAM regions: one ``slots x page`` file per group, mapped MAP_SHARED.

A region lives under ``/dev/shm`` by default so other processes (tensor-parallel workers)
attach by path and see the same bytes. Its owner holds an flock on a lease file for as long
as it lives; the kernel drops the lock when the owner dies, however it dies, so a later start
removes the regions of killed owners and never a live owner's. A lock, unlike a PID, means
the same thing in every container that shares the directory.

Every process that maps a region maps the pages of the slots in use and a window beyond them
on a thread of its own (``map_ahead``): the first write into a freshly mapped 4 KiB page costs
a page fault, and a store copying into never-touched slots ran at 3 GB/s instead of 19 GB/s,
on the engine's step. A CUDA pin hook maps every page already when it registers the region.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hybridkv.core.errors import HybridKVError

log = logging.getLogger(__name__)


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


MADV_POPULATE_WRITE = 23          # Linux 5.14+: map pages writable without touching them
POPULATE_CHUNK = 16 << 20         # per call; closing a region waits for at most one
MAP_AHEAD_BYTES = 64 << 20        # mapped beyond the slots in use: the next stores' slots


def _page_up(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


class _Populator:
    """One thread per process maps pages of its regions before a copy needs them: the slots in
    use and ``MAP_AHEAD_BYTES`` beyond (pools hand out slots from 0 up, so those are the next
    ones a store takes), the least mapped region's next chunk first. Mapping a whole region up
    front cost ~0.25 s of a core per GiB in every process and slowed the first requests on a
    small machine; this maps what the slots in use need, and a window. It never writes a
    byte, so it runs while other processes use the pages; ``madvise`` runs through ctypes,
    which releases the GIL. It holds a region only while mapping a chunk of it, so a region
    nobody closes is still collected. Where the kernel lacks MADV_POPULATE_WRITE (before
    5.14) nothing is mapped ahead: pages fault in as they are first used."""

    def __init__(self):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._changed = threading.Condition()
        # region -> [bytes mapped, bytes to map]; weak, so a region nobody closes is collected
        self._jobs: weakref.WeakKeyDictionary[SharedRegion, list[int]] = weakref.WeakKeyDictionary()
        self._busy: SharedRegion | None = None    # the region madvise is working on now
        self._thread: threading.Thread | None = None
        self.unsupported: str | None = None      # why the kernel cannot, once probed
        self._probed = False

    def _madvise(self, address: int, nbytes: int) -> int:
        """0, or the errno of a failed MADV_POPULATE_WRITE."""
        failed = self._libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), MADV_POPULATE_WRITE)
        return ctypes.get_errno() if failed else 0

    def _probe(self) -> bool:
        """Does this kernel know MADV_POPULATE_WRITE? Asked once, of a page of our own."""
        if not self._probed:
            self._probed = True
            page = mmap.mmap(-1, mmap.PAGESIZE)
            error = self._madvise(np.frombuffer(page, np.uint8).ctypes.data, mmap.PAGESIZE)
            page.close()
            if error:
                self.unsupported = os.strerror(error)
                log.info("RAM pages fault in as first used (madvise: %s)", self.unsupported)
        return self.unsupported is None

    def map_to(self, region: SharedRegion, nbytes: int) -> None:
        """Have the region's first ``nbytes`` mapped, rounded up to whole memory pages."""
        with self._changed:
            if not self._probe():
                return
            job = self._jobs.setdefault(region, [0, 0])
            job[1] = max(job[1], min(_page_up(nbytes), _page_up(region.nbytes)))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="hybridkv-map-pages", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def mapped(self, region: SharedRegion) -> int | None:
        """Bytes of the region mapped so far; None if it is not (or no longer) known here."""
        with self._changed:
            job = self._jobs.get(region)
            return None if job is None else job[0]

    def wait(self, region: SharedRegion, timeout: float) -> bool:
        """Wait until what the region asked for is mapped (or given up on); False on timeout."""
        def done() -> bool:
            job = self._jobs.get(region)
            return job is None or job[0] >= job[1]
        with self._changed:
            return self._changed.wait_for(done, timeout)

    def remove(self, region: SharedRegion) -> None:
        """Forget the region, waiting out a chunk in progress: the caller is about to unmap."""
        with self._changed:
            self._jobs.pop(region, None)
            self._changed.wait_for(lambda: self._busy is not region)

    def _next(self) -> tuple[SharedRegion, int, int] | None:
        """The next chunk: the least mapped region's (under the lock; drops closed regions)."""
        for region in [r for r, (done, target) in self._jobs.items() if done < target and r.array is None]:
            del self._jobs[region]
        pending = [(done, id(r), r) for r, (done, target) in self._jobs.items() if done < target]
        if not pending:
            return None
        done, _, region = min(pending)
        return region, done, min(POPULATE_CHUNK, self._jobs[region][1] - done)

    def _run(self) -> None:
        while True:
            with self._changed:
                chunk = self._next()
                while chunk is None:            # idle until a region asks for more
                    self._changed.wait()
                    chunk = self._next()
                region, done, n = chunk         # held (mapped) until this chunk is done
                address = region.array.ctypes.data + done
                self._busy = region
            error = errno.EFAULT                # should madvise raise
            try:
                error = self._madvise(address, n)
            finally:                            # never leave _busy set: close() waits on it
                with self._changed:
                    self._busy = None
                    job = self._jobs.get(region)
                    if job is not None and error:
                        job[0] = job[1] = _page_up(region.nbytes)     # given up on: never asked again
                        log.warning("mapping RAM region %s ahead of use stopped: %s",
                                    region.path, os.strerror(error))
                    elif job is not None:
                        job[0] = done + n
                    self._changed.notify_all()
            del region

    def forget_after_fork(self) -> None:
        """A forked child has no thread and maps its inherited regions on its own account."""
        self._changed = threading.Condition()
        self._jobs, self._busy, self._thread = weakref.WeakKeyDictionary(), None, None


POPULATOR = _Populator()
os.register_at_fork(after_in_child=POPULATOR.forget_after_fork)


class SharedRegion:
    """``slots`` pages of ``page_bytes`` each in one shared mapping."""

    def __init__(self, path: Path, slots: int, page_bytes: int, fd: int, owner: bool):
        self.path, self.slots, self.page_bytes = path, slots, page_bytes
        self._fd = fd
        self._map = mmap.mmap(fd, slots * page_bytes, mmap.MAP_SHARED)
        self.array = np.frombuffer(self._map, dtype=np.uint8).reshape(slots, page_bytes)
        self._unlinker = None
        self._unpin: Callable[[], None] | None = None
        self._pinned = False               # a pin hook ran: every page is mapped
        self._map_target = 0               # bytes asked to be mapped ahead so far
        self._segments: set[int] = set()             # an arena's segments asked to be mapped
        self._stretches: list[_Stretch] = []          # ...in runs of adjacent ones
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

    def map_ahead(self, slots_used: int) -> None:
        """Slots below ``slots_used`` are in use: have them and at least a window beyond mapped
        in this process, in the background (a pinned region is mapped whole already). Nothing
        is mapped before a slot is used: at start the mapping would compete with the first
        requests (a restore right after a start ran 1.5x slower). Short of a window it asks
        for two, so the work comes in a few large steps, not a sliver at every engine step;
        at most steps it has nothing to ask and returns at once."""
        if slots_used <= 0 or self._pinned or self._map is None:    # unused, pinned or closed
            return
        ahead = max(MAP_AHEAD_BYTES, self.page_bytes)
        needed = min(self.nbytes, slots_used * self.page_bytes + ahead)
        if needed > self._map_target:
            self._map_target = min(self.nbytes, needed + ahead)
            POPULATOR.map_to(self, self._map_target)

    def view(self, page_bytes: int) -> RegionView:
        """The same bytes as rows of ``page_bytes`` (an arena's view for one group)."""
        return RegionView(self, page_bytes)

    def map_segments(self, segments: list[int], segment_bytes: int) -> None:
        """Have these segments of an arena mapped in the background (see ``map_ahead``), each
        run of adjacent new ones as one job: small pages make thousands of segments."""
        if self._pinned or self._map is None:
            return
        runs: list[list[int]] = []            # [first, last] of each run of new segments
        for index in sorted(set(segments) - self._segments):
            if runs and index == runs[-1][1] + 1:
                runs[-1][1] = index
            else:
                runs.append([index, index])
            self._segments.add(index)
        for first, last in runs:
            stretch = _Stretch(self, first * segment_bytes, (last + 1 - first) * segment_bytes)
            self._stretches.append(stretch)
            POPULATOR.map_to(stretch, stretch.nbytes)

    def run_pin_hook(self, hook: PinHook, rank: int = 0) -> None:
        """Run e.g. CUDA host registration under an exclusive flock; failure is fatal."""
        lock_fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            self._unpin = hook(self)
            self._pinned = True
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
        POPULATOR.remove(self)
        for stretch in self._stretches:
            POPULATOR.remove(stretch)
        self._stretches.clear()
        self._segments.clear()
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


class _Stretch:
    """Adjacent segments of an arena the populator maps as if they were a region of their own."""

    def __init__(self, arena: SharedRegion, start: int, nbytes: int):
        self.path, self.nbytes = arena.path, nbytes
        self.array = arena.array.reshape(-1)[start:start + nbytes]


class RegionView:
    """One group's view of a shared arena: the arena's bytes as rows of the group's page size.
    It shares the arena's mapping (and its pinning); closing it closes the arena, which every
    group's view does at the same time (a cache closing, a re-plan, a worker re-attaching)."""

    def __init__(self, base: SharedRegion, page_bytes: int):
        self.base, self.path, self.page_bytes = base, base.path, page_bytes
        self.slots = base.nbytes // page_bytes
        self.array = base.array.reshape(-1)[: self.slots * page_bytes].reshape(self.slots, page_bytes)

    @property
    def nbytes(self) -> int:
        return self.slots * self.page_bytes

    page = SharedRegion.page
    pages = SharedRegion.pages
    write = SharedRegion.write

    def map_ahead(self, slots_used: int) -> None:
        """Nothing here: the cache maps an arena's segments in use (``map_segments``)."""

    def close(self) -> None:
        self.array = None
        self.base.close()


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

    def map_ahead(self, slots_used: int) -> None:
        """Nothing to map."""

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
