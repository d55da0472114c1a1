"""Tier benchmarks beside their ceilings measured in the same run: RAM slots vs plain memcpy,
the filesystem tier vs the same writes and reads done raw (and ``dd``), opening large stores,
Redis batched and per key vs ``redis-benchmark``."""

from __future__ import annotations

import math
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hybridkv.tiers import pagefile
from hybridkv.tools.bench_common import GB, MiB, gbps, median, page_layout


def _first_copy_gbps(path: Path, src: np.ndarray, ahead: bool) -> float:
    """GB/s of the first copy into every slot of a region just made: its slots mapped ahead,
    as the window has them before the stores reach them (``SharedRegion.map_ahead``, waited
    for), or faulting in as the copy touches them (a plain mapping of the same kind of file,
    as the region was before it mapped ahead)."""
    from hybridkv.ram.regions import POPULATOR, SharedRegion

    pages, page_bytes = src.shape
    if ahead:
        region = SharedRegion.create(path, pages, page_bytes)
        region.map_ahead(pages)
        POPULATOR.wait(region, 60)
        dest, close = region.array, region.close
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.posix_fallocate(fd, 0, src.nbytes)
        mapping = mmap.mmap(fd, src.nbytes, mmap.MAP_SHARED)
        dest = np.frombuffer(mapping, np.uint8).reshape(pages, page_bytes)

        def close():
            mapping.close()
            os.close(fd)
            path.unlink()
    try:
        t = time.perf_counter()
        for i in range(pages):
            np.copyto(dest[i], src[i])
        return gbps(src.nbytes, time.perf_counter() - t)
    finally:
        del dest
        close()


def bench_ram(page_bytes: int = 4 * MiB, pages: int = 64, repeats: int = 5) -> dict:
    """Copy pages into RAM-region slots vs np.copyto between two plain arrays (memcpy), and
    the first copy into a new region's slots with and without its pages mapped ahead."""
    from hybridkv.ram.regions import SharedRegion

    src = np.random.default_rng(0).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    plain = np.empty_like(src)
    path = Path(tempfile.gettempdir() if not os.path.isdir("/dev/shm") else "/dev/shm") / f"hybridkv-bench-{os.getpid()}"
    first = {ahead: median(lambda a=ahead: _first_copy_gbps(path, src, a), repeats) for ahead in (True, False)}
    region = SharedRegion.create(path, pages, page_bytes)
    try:
        for i in range(pages):          # touch every page once so neither side pays page faults
            region.write(i, src[i])
            plain[i] = src[i]

        def slots() -> float:
            t = time.perf_counter()
            for i in range(pages):
                region.write(i, src[i])
            return gbps(src.nbytes, time.perf_counter() - t)

        def memcpy() -> float:
            t = time.perf_counter()
            for i in range(pages):
                np.copyto(plain[i], src[i])
            return gbps(src.nbytes, time.perf_counter() - t)

        copy, copy_spread = median(slots, repeats)
        base, base_spread = median(memcpy, repeats)
    finally:
        region.close()
    return {"page_bytes": page_bytes, "copy_gbps": copy, "memcpy_gbps": base, "ratio": copy / base,
            "first_copy_gbps": first[True][0], "first_copy_unmapped_gbps": first[False][0],
            "spread": {"copy_gbps": copy_spread, "memcpy_gbps": base_spread}}


def bench_arena_move(page_bytes: int = 6 * MiB, pages: int = 66, repeats: int = 5) -> dict:
    """An arena move's copy (``pages`` idle pages relocated within one region, by default the
    394 MiB a move averages on the public chat hour at 128 GiB in Qwen3-Next's 6 MiB pages) on
    one thread and on ``relocation.THREADS``, against one memcpy of the same bytes in one
    piece on one thread (the ceiling of a single thread)."""
    from hybridkv.ram import relocation
    from hybridkv.ram.regions import SharedRegion

    path = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / f"hybridkv-bench-move-{os.getpid()}"
    region = SharedRegion.create(path, 2 * pages, page_bytes)
    moves = [(region, pages + i, i) for i in range(pages)]
    try:
        region.array[:] = 1            # every page faulted in: the move copies, nothing else

        def timed(copy: Callable[[], None]) -> float:
            t = time.perf_counter()
            copy()
            return (time.perf_counter() - t) * 1000

        def memcpy() -> None:
            np.copyto(region.array[:pages], region.array[pages:])

        out: dict = {"page_bytes": page_bytes, "pages": pages, "threads": relocation.THREADS, "spread_ms": {}}
        for name, threshold in (("one_thread", math.inf), ("threaded", 0)):
            out[f"{name}_ms"], out["spread_ms"][name] = median(
                lambda t=threshold: timed(lambda: relocation.copy_moves(moves, parallel_bytes=t)), repeats)
        out["memcpy_ms"], out["spread_ms"]["memcpy"] = median(lambda: timed(memcpy), repeats)
    finally:
        region.close()
    nbytes = page_bytes * pages
    out.update(one_thread_gbps=gbps(nbytes, out["one_thread_ms"] / 1000), threaded_gbps=gbps(nbytes, out["threaded_ms"] / 1000),
               memcpy_gbps=gbps(nbytes, out["memcpy_ms"] / 1000), speedup=out["one_thread_ms"] / out["threaded_ms"])
    return out


def _raw_io(directory: Path, pages: np.ndarray, direct: bool) -> tuple[float, float]:
    """The same files written and read without hybridkv: one os.write / os.read per page."""
    flags = os.O_DIRECT if direct else 0
    size = pages.shape[1]
    buf = mmap.mmap(-1, -(-size // 4096) * 4096)
    t = time.perf_counter()
    for i, row in enumerate(pages):
        fd = os.open(directory / f"raw{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
        if direct:                       # O_DIRECT needs an aligned buffer, as the tier uses
            buf[:size] = row
            os.write(fd, buf)
        else:
            os.write(fd, row)
        os.close(fd)
    write = gbps(pages.nbytes, time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(len(pages)):
        fd = os.open(directory / f"raw{i}", os.O_RDONLY | flags)
        os.preadv(fd, [buf], 0)
        os.close(fd)
    read = gbps(pages.nbytes, time.perf_counter() - t)
    buf.close()
    return write, read

def bench_fs(directory: str | None = None, page_bytes: int = 4 * MiB, pages: int = 64,
             repeats: int = 3) -> dict:
    """FilesystemTier write/read vs raw per-file I/O of the same bytes on the same disk."""
    from hybridkv.tiers.filesystem import FilesystemTier, probe_direct_io

    base = Path(directory or tempfile.mkdtemp(prefix="hybridkv-bench-fs-"))
    base.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(1).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    layout = page_layout(page_bytes)
    out = np.empty(page_bytes, np.uint8)
    modes = {"buffered": False}
    if probe_direct_io(base):
        modes["direct"] = True
    result: dict = {"page_bytes": page_bytes, "pages": pages}
    try:
        for mode, direct in modes.items():
            runs = {"write": [], "read": [], "raw_write": [], "raw_read": []}
            for r in range(repeats):
                root = base / f"{mode}{r}"
                tier = FilesystemTier(root, layout, direct=direct)
                t = time.perf_counter()
                for i in range(pages):
                    tier.write(0, i.to_bytes(16, "big"), data[i])
                runs["write"].append(gbps(data.nbytes, time.perf_counter() - t))
                t = time.perf_counter()
                for i in range(pages):
                    assert tier.read(0, i.to_bytes(16, "big"), out)
                runs["read"].append(gbps(data.nbytes, time.perf_counter() - t))
                tier.close()
                raw_dir = base / f"raw-{mode}{r}"
                raw_dir.mkdir()
                w, rd = _raw_io(raw_dir, data, direct)
                runs["raw_write"].append(w)
                runs["raw_read"].append(rd)
            med = {k: statistics.median(v) for k, v in runs.items()}
            result[mode] = {
                "write_gbps": med["write"], "read_gbps": med["read"],
                "raw_write_gbps": med["raw_write"], "raw_read_gbps": med["raw_read"],
                "write_ratio": med["write"] / med["raw_write"], "read_ratio": med["read"] / med["raw_read"],
                "spread": {k: [min(v), max(v)] for k, v in runs.items()},
            }
        result["dd_write_gbps"] = _dd(base, page_bytes, pages)
    finally:
        if directory is None:
            shutil.rmtree(base, ignore_errors=True)
    top = result.get("direct", result["buffered"])
    result.update({k: top[k] for k in ("write_gbps", "read_gbps", "raw_write_gbps", "raw_read_gbps",
                                       "write_ratio", "read_ratio")})
    result["mode"] = "direct" if "direct" in result else "buffered"
    return result

def bench_fs_batch(page_sizes: tuple[int, ...] = (32 * 1024, 256 * 1024, 2 * MiB, 10 * MiB),
                   total_bytes: int = 64 * MiB, repeats: int = 9) -> list[dict]:
    """Batched reads as a promotion does them (``submit_reads``: verified, copied into the
    destination pages) vs raw reads of the very same files the way the tier reads them, and
    vs raw reads of the same pages stored one file each (the layout small pages had before
    packs). The three alternate, repeat by repeat, so a disk whose speed drifts (a shared VM)
    moves all of them alike, and each repeat starts with the next of them: this VM's disk reads
    bytes it read a moment ago up to 2x faster, so a fixed order favours the second. The
    medians are reported."""
    from hybridkv.tiers.filesystem import FilesystemTier

    rows = []
    for page_bytes in page_sizes:
        root = Path(tempfile.mkdtemp(prefix="hybridkv-bench-batch-"))
        one_each = Path(tempfile.mkdtemp(prefix="hybridkv-bench-per-page-"))
        pages = max(8, total_bytes // page_bytes)
        try:
            tier = FilesystemTier(root, page_layout(page_bytes))
            payload = np.random.default_rng(page_bytes).integers(0, 256, page_bytes, dtype=np.uint8)
            keys = [i.to_bytes(16, "big") for i in range(pages)]
            for future in tier.submit_writes([(0, k, payload) for k in keys]):
                future.result()
            blob = bytes(pagefile.HEADER_BYTES) + payload.tobytes()
            for i in range(pages):
                (one_each / f"{i}.blk").write_bytes(blob)
            # page-aligned destinations, as the slots of a RAM region are
            slots = np.frombuffer(mmap.mmap(-1, pages * page_bytes), np.uint8).reshape(pages, page_bytes)
            items = [(0, k, slots[i]) for i, k in enumerate(keys)]
            same, per_file = SamePages(root), SamePages(one_each)
            runs: dict[str, list[float]] = {"tier": [], "raw": [], "per_file": []}
            for r in range(repeats):
                for name in rotated(list(runs), r):
                    if name == "tier":
                        runs[name].append(gbps(pages * page_bytes, _timed_reads(tier, items)))
                    else:
                        runs[name].append((same if name == "raw" else per_file).raw_read_gbps())
            tier.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(one_each, ignore_errors=True)
        med = {name: statistics.median(values) for name, values in runs.items()}
        rows.append({"page_bytes": page_bytes, "pages": pages, "read_gbps": med["tier"],
                     "mode": same.facts()["raw_read_mode"], "raw_read_gbps": med["raw"],
                     "ratio": med["tier"] / med["raw"], "raw_read_file_per_page_gbps": med["per_file"],
                     "spread_gbps": [min(runs["tier"]), max(runs["tier"])]})
    return rows

def rotated(names: list[str], r: int) -> list[str]:
    """The order of repeat ``r``: each name goes first in turn."""
    return names[r % len(names):] + names[:r % len(names)]

def _timed_reads(tier, items) -> float:
    t = time.perf_counter()
    if not all(f.result() for f in tier.submit_reads(items)):
        raise RuntimeError("a benchmark page did not read back")
    return time.perf_counter() - t

def make_file_store(root: Path, layout, pages: int, first: int = 0) -> Path:
    """``pages`` page files of group 0 (keys ``first``...), 64 B each: a scan reads names and
    stat, not contents, so small files suffice. Returns the namespace directory."""
    from hybridkv.tiers.filesystem import FilesystemTier, page_file

    empty = FilesystemTier(root, layout)    # creates the namespace with the store's modes
    empty.close()
    namespace = str(empty.namespace)
    blob = b"\0" * 64
    for i in range(first, first + pages):
        path = page_file(namespace, 0, i.to_bytes(16, "big"))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, blob)
        os.close(fd)
    return empty.namespace

def bench_fs_startup(pages: int = 200_000, page_bytes: int = 32 * 1024) -> dict:
    """Opening a store of ``pages`` page files: time until the tier serves, until its
    background scan has indexed every page, and the index's bytes per page; the ceiling is
    a raw ``scandir`` + ``lstat`` walk of the same files (all with warm directory caches)."""
    layout = page_layout(page_bytes)
    root = Path(tempfile.mkdtemp(prefix="hybridkv-bench-startup-"))
    try:
        namespace = str(make_file_store(root, layout, pages))

        def raw_walk() -> float:
            t = time.perf_counter()
            for sub in os.scandir(f"{namespace}/g0"):
                for entry in os.scandir(sub.path):
                    entry.stat(follow_symlinks=False)
            return time.perf_counter() - t

        raw = min(raw_walk() for _ in range(2))
        opening = _time_opening(root, layout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    index_bytes = opening.pop("index_bytes")
    return {"pages": pages, **opening, "raw_walk_s": raw, "scan_ratio": opening["scanned_s"] / raw,
            "index_bytes_per_page": index_bytes / pages}

def _time_opening(root: Path, layout) -> dict:
    """Open the store at ``root``: time until the tier serves, until the pack tables are read,
    until the scan ends; then the index's bytes (tracemalloc, a second open)."""
    import tracemalloc

    from hybridkv.tiers.filesystem import FilesystemTier

    t = time.perf_counter()
    tier = FilesystemTier(root, layout)
    opened = time.perf_counter() - t
    tier.packs_indexed.wait()
    packed = time.perf_counter() - t
    tier.wait_scanned()
    scanned = time.perf_counter() - t
    indexed = tier.indexed_pages()
    tier.close()
    tracemalloc.start()
    tier = FilesystemTier(root, layout)
    tier.wait_scanned()
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    tier.close()
    return {"indexed": indexed, "open_s": opened, "packed_served_s": packed, "scanned_s": scanned,
            "index_bytes": index_bytes}

def make_packed_store(root: Path, layout, pages: int, page_bytes: int = 32 * 1024, per_pack: int = 256) -> None:
    """A store of ``pages`` pages of group 0 in packs, as the tier writes them: sparse files
    with real tables (a scan reads tables, not pages)."""
    from hybridkv.tiers import packfile
    from hybridkv.tiers.filesystem import PACKS, FilesystemTier

    empty = FilesystemTier(root, layout)
    empty.close()
    packs = empty.namespace / PACKS
    packs.mkdir(mode=0o700)
    span = packfile.aligned(page_bytes)
    for first in range(0, pages, per_pack):
        count = min(per_pack, pages - first)
        table = packfile.encode_table(packfile.make_table(
            [(0, (first + i).to_bytes(16, "big"), i * span, page_bytes, 0) for i in range(count)]))
        fd = os.open(packs / f"{first:016x}{packfile.SUFFIX}", os.O_WRONLY | os.O_CREAT, 0o600)
        os.pwrite(fd, table, count * span)
        os.close(fd)

def bench_fs_startup_packed(pages: int = 1_000_000, page_bytes: int = 32 * 1024, per_pack: int = 256) -> dict:
    """Opening a store of ``pages`` small pages in packs (as the tier writes them): time until
    it serves, until the packed pages are served (the scan reads each pack's table first),
    until everything is ordered, and the index's bytes per page."""
    layout = page_layout(page_bytes)
    root = Path(tempfile.mkdtemp(prefix="hybridkv-bench-packed-"))
    try:
        make_packed_store(root, layout, pages, page_bytes, per_pack)
        opening = _time_opening(root, layout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    index_bytes = opening.pop("index_bytes")
    return {"pages": pages, "packs": -(-pages // per_pack), **opening, "index_bytes_per_page": index_bytes / pages}

def _dd(directory: Path, block: int, count: int) -> float | None:
    """`dd` writing the same bytes with the same block size (O_DIRECT when it is accepted)."""
    if shutil.which("dd") is None:
        return None
    target = directory / "dd.out"
    args = ["dd", "if=/dev/zero", f"of={target}", f"bs={block}", f"count={count}", "oflag=direct"]
    t = time.perf_counter()
    proc = subprocess.run(args, capture_output=True)
    if proc.returncode != 0:
        args[-1] = "conv=fsync"
        t = time.perf_counter()
        subprocess.run(args, capture_output=True)
    seconds = time.perf_counter() - t
    target.unlink(missing_ok=True)
    return gbps(block * count, seconds)

def bench_remote(url: str, page_bytes: int = MiB, pages: int = 64, repeats: int = 3) -> dict:
    """The tier's slot path (pipelines straight between the RAM slots and the socket) and its
    redis-py path vs naive per-key SET/GET vs redis-benchmark with the same value size, one
    client, the slot path's pipeline depth, as many keys and as many requests (the tier's
    timing covers as many passes over its pages as redis-benchmark makes over its keys: a
    single pass right after the other clients' writes measured slower, a cost redis-benchmark
    spreads over its whole run). redis-benchmark runs in each
    repeat, right after the tier's timings (this loopback's speed drifts between runs by
    more than the ratios asked of the tier), and the ratios are the medians of each
    repeat's own."""
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    from hybridkv.tiers.remote import RAW_PIPELINE_BYTES, RemoteTier

    layout = page_layout(page_bytes)
    data = np.random.default_rng(2).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    tiers = {"": RemoteTier(url, layout, prefix="hybridkv-bench", timeout_s=10),
             "redis_py_": RemoteTier(url, layout, prefix="hybridkv-bench", timeout_s=10, raw=False)}
    client = redis.Redis.from_url(url, socket_timeout=10)
    keys = [i.to_bytes(16, "big") for i in range(pages)]
    outs = [np.empty(page_bytes, np.uint8) for _ in range(pages)]
    runs = {f"{name}{op}": [] for name in tiers for op in ("set", "get")}
    runs.update({"naive_set": [], "naive_get": []})
    writes = [(0, k, data[i]) for i, k in enumerate(keys)]
    reads = [(0, k, outs[i]) for i, k in enumerate(keys)]
    for tier in tiers.values():       # untimed: the server's first allocation of the values
        tier.write_many(writes)
        tier.read_many(reads)
    depth = max(1, RAW_PIPELINE_BYTES // page_bytes)
    requests = max(1000, 2 * data.nbytes // page_bytes)     # redis-benchmark's, per command
    passes = -(-requests // pages)
    paired: list[tuple[dict, dict]] = []    # each repeat's redis-benchmark figures and the tier's
    for _ in range(repeats):
        for name, tier in tiers.items():
            t = time.perf_counter()
            for _ in range(passes):
                tier.write_many(writes)
            runs[f"{name}set"].append(gbps(passes * data.nbytes, time.perf_counter() - t))
            t = time.perf_counter()
            ok = [all(tier.read_many(reads)) for _ in range(passes)]
            runs[f"{name}get"].append(gbps(passes * data.nbytes, time.perf_counter() - t))
            assert all(ok)
        t = time.perf_counter()
        for _ in range(passes):
            for i in range(pages):
                client.set(f"hybridkv-bench-naive:{i}", data[i].tobytes())
        runs["naive_set"].append(gbps(passes * data.nbytes, time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(passes):
            for i in range(pages):
                client.get(f"hybridkv-bench-naive:{i}")
        runs["naive_get"].append(gbps(passes * data.nbytes, time.perf_counter() - t))
        ceiling = _redis_benchmark(url, page_bytes, depth, pages, requests)
        if ceiling is not None:
            paired.append((ceiling, {op: runs[op][-1] for op in ("set", "get")}))
    for name in client.scan_iter(match="hybridkv-bench*"):
        client.delete(name)
    for tier in tiers.values():
        tier.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    ceiling = None
    if paired:
        by_op = {op: [c[f"{op}_gbps"] for c, _ in paired] for op in ("set", "get")}
        ceiling = {**paired[0][0], **{f"{op}_gbps": statistics.median(v) for op, v in by_op.items()},
                   "repeats": len(paired),
                   "ratios": {op: statistics.median(tier[op] / c[f"{op}_gbps"] for c, tier in paired)
                              for op in by_op},
                   "spread": {op: [min(v), max(v)] for op, v in by_op.items()}}
    return {"page_bytes": page_bytes, "pages": pages, "hiredis": HIREDIS_AVAILABLE, "pipeline": depth, "passes": passes,
            **{f"{k}_gbps": v for k, v in med.items()},
            "redis_benchmark": ceiling,
            "spread": {k: [min(v), max(v)] for k, v in runs.items()}}


def _redis_benchmark(url: str, value_bytes: int, pipeline: int, keys: int, requests: int) -> dict | None:
    """The server's own client with the same value size, one connection, the same pipeline
    depth and as many distinct keys (one hot key would be served from the CPU's caches):
    the wire ceiling for what the tier does."""
    from urllib.parse import urlsplit

    if shutil.which("redis-benchmark") is None:
        return None
    parts = urlsplit(url)
    proc = subprocess.run(
        ["redis-benchmark", "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379),
         "-t", "set,get", "-n", str(requests), "-d", str(value_bytes), "-c", "1", "-P", str(pipeline),
         "-r", str(keys), "-q", "--csv"],
        capture_output=True, text=True, timeout=300)
    out = {"requests": requests, "clients": 1, "pipeline": pipeline, "keys": keys}
    for line in proc.stdout.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells and cells[0] in ("SET", "GET"):
            out[f"{cells[0].lower()}_gbps"] = float(cells[1]) * value_bytes / GB
    return out if len(out) > 4 else None


class SamePages:
    """The very files a benchmark read, and two ceilings over them: raw reads the way the
    tier reads them (``O_DIRECT`` where it is accepted, the tier's 4 threads, requests of at
    most ``RUN_BYTES``), and the pages' bytes copied page by page in memory. Listed once;
    each call is one sample, so samples can alternate with what they bound."""

    def __init__(self, store: Path, threads: int = 4):
        from hybridkv.tiers import packfile
        from hybridkv.tiers.filesystem import RUN_BYTES, probe_direct_io

        files = sorted(store.rglob("*.blk")) + sorted(store.rglob(f"*{packfile.SUFFIX}"))
        self.file_bytes = [f.stat().st_size for f in files]
        self.pages = [size for f, size in zip(files, self.file_bytes, strict=True) if f.suffix == ".blk"]
        for f in files[len(self.pages):]:
            self.pages += _page_spans(f)
        self.direct = probe_direct_io(files[0].parent)
        chunk = min(RUN_BYTES, packfile.aligned(max(self.file_bytes)))
        self.requests = [(f, at) for f, size in zip(files, self.file_bytes, strict=True)
                         for at in range(0, size, chunk)]
        self.buffers = [mmap.mmap(-1, chunk) for _ in range(threads)]
        self.files, self.threads = files, threads

    def facts(self) -> dict:
        return {"files_on_disk": len(self.files), "pages_on_disk": len(self.pages),
                "page_bytes_on_disk": sorted(set(self.pages)),
                "raw_read_mode": "direct" if self.direct else "buffered"}

    def raw_read_gbps(self) -> float:
        from concurrent.futures import ThreadPoolExecutor

        def read_share(i: int) -> None:
            for f, at in self.requests[i::self.threads]:
                fd = os.open(f, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
                os.preadv(fd, [self.buffers[i]], at)
                os.close(fd)

        t = time.perf_counter()
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(read_share, range(self.threads)))
        return gbps(sum(self.file_bytes), time.perf_counter() - t)

    def memcpy_gbps(self, repeats: int) -> float:
        src, dst = np.ones(sum(self.pages), np.uint8), np.empty(sum(self.pages), np.uint8)
        bounds = np.cumsum([0, *self.pages]).tolist()

        def copy() -> float:
            t = time.perf_counter()
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                np.copyto(dst[a:b], src[a:b])
            return time.perf_counter() - t

        return gbps(sum(self.pages), median(copy, repeats)[0])

def _page_spans(pack: Path) -> list[int]:
    """Bytes of each page in a pack (payload and padding)."""
    from hybridkv.tiers import packfile

    fd = os.open(pack, os.O_RDONLY)
    try:
        return [packfile.aligned(length) for length in packfile.read_table(fd)["length"].tolist()]
    finally:
        os.close(fd)
