"""``hybridkv bench``: every figure next to the ceiling measured in the same run.

Parts: tier copy speeds (RAM slots vs plain memcpy; filesystem tier vs the same writes and
reads done raw; Redis batched vs per-key vs redis-benchmark), manager operations per second,
restore vs recompute TTFT on the default model. State policies on workloads and traces are
``bench_policies``.
"""

from __future__ import annotations

import contextlib
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

from hybridkv.config import CacheConfig
from hybridkv.core.layout import layout_from_dict
from hybridkv.tiers import pagefile
from hybridkv.tools import bench_manager

GB = 1e9
MiB = 1024 * 1024


def _median(fn: Callable[[], float], repeats: int) -> tuple[float, list[float]]:
    values = [fn() for _ in range(repeats)]
    return statistics.median(values), [min(values), max(values)]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB


def _page_layout(page_bytes: int):
    return layout_from_dict({"model": "bench", "block_tokens": 64, "max_model_len": 1 << 20,
                             "groups": [{"id": 0, "kind": "attention", "page_bytes": page_bytes}]})


# -- 1. tiers ---------------------------------------------------------------------------------
def bench_ram(page_bytes: int = 4 * MiB, pages: int = 64, repeats: int = 5) -> dict:
    """Copy pages into RAM-region slots vs np.copyto between two plain arrays (memcpy)."""
    from hybridkv.ram.regions import SharedRegion

    src = np.random.default_rng(0).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    plain = np.empty_like(src)
    path = Path(tempfile.gettempdir() if not os.path.isdir("/dev/shm") else "/dev/shm") / f"hybridkv-bench-{os.getpid()}"
    region = SharedRegion.create(path, pages, page_bytes)
    try:
        for i in range(pages):          # touch every page once so neither side pays page faults
            region.write(i, src[i])
            plain[i] = src[i]

        def slots() -> float:
            t = time.perf_counter()
            for i in range(pages):
                region.write(i, src[i])
            return _gbps(src.nbytes, time.perf_counter() - t)

        def memcpy() -> float:
            t = time.perf_counter()
            for i in range(pages):
                np.copyto(plain[i], src[i])
            return _gbps(src.nbytes, time.perf_counter() - t)

        copy, copy_spread = _median(slots, repeats)
        base, base_spread = _median(memcpy, repeats)
    finally:
        region.close()
    return {"page_bytes": page_bytes, "copy_gbps": copy, "memcpy_gbps": base, "ratio": copy / base,
            "spread": {"copy_gbps": copy_spread, "memcpy_gbps": base_spread}}


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
    write = _gbps(pages.nbytes, time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(len(pages)):
        fd = os.open(directory / f"raw{i}", os.O_RDONLY | flags)
        os.preadv(fd, [buf], 0)
        os.close(fd)
    read = _gbps(pages.nbytes, time.perf_counter() - t)
    buf.close()
    return write, read


def bench_fs(directory: str | None = None, page_bytes: int = 4 * MiB, pages: int = 64,
             repeats: int = 3) -> dict:
    """FilesystemTier write/read vs raw per-file I/O of the same bytes on the same disk."""
    from hybridkv.tiers.filesystem import FilesystemTier, probe_direct_io

    base = Path(directory or tempfile.mkdtemp(prefix="hybridkv-bench-fs-"))
    base.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(1).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    layout = _page_layout(page_bytes)
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
                runs["write"].append(_gbps(data.nbytes, time.perf_counter() - t))
                t = time.perf_counter()
                for i in range(pages):
                    assert tier.read(0, i.to_bytes(16, "big"), out)
                runs["read"].append(_gbps(data.nbytes, time.perf_counter() - t))
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
            tier = FilesystemTier(root, _page_layout(page_bytes))
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
            same, per_file = _SamePages(root), _SamePages(one_each)
            runs: dict[str, list[float]] = {"tier": [], "raw": [], "per_file": []}
            for r in range(repeats):
                for name in _rotated(list(runs), r):
                    if name == "tier":
                        runs[name].append(_gbps(pages * page_bytes, _timed_reads(tier, items)))
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


def _rotated(names: list[str], r: int) -> list[str]:
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
    layout = _page_layout(page_bytes)
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
    layout = _page_layout(page_bytes)
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
    return _gbps(block * count, seconds)


def bench_remote(url: str, page_bytes: int = MiB, pages: int = 64, repeats: int = 3) -> dict:
    """Batched pipelines vs naive per-key SET/GET vs redis-benchmark, same value size; with
    hiredis installed, also with its own command packer (what redis-py does by default)."""
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    from hybridkv.tiers.remote import RemoteTier

    layout = _page_layout(page_bytes)
    data = np.random.default_rng(2).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    tiers = {"": RemoteTier(url, layout, prefix="hybridkv-bench", timeout_s=10)}
    if HIREDIS_AVAILABLE:
        tiers["hiredis_packer_"] = RemoteTier(url, layout, prefix="hybridkv-bench", timeout_s=10,
                                              python_packer=False)
    client = redis.Redis.from_url(url, socket_timeout=10)
    keys = [i.to_bytes(16, "big") for i in range(pages)]
    outs = [np.empty(page_bytes, np.uint8) for _ in range(pages)]
    runs = {f"{name}{op}": [] for name in tiers for op in ("set", "get")}
    runs.update({"naive_set": [], "naive_get": []})
    for tier in tiers.values():       # untimed: the server's first allocation of the values
        tier.write_many([(0, k, data[i]) for i, k in enumerate(keys)])
        tier.read_many([(0, k, outs[i]) for i, k in enumerate(keys)])
    for _ in range(repeats):
        for name, tier in tiers.items():
            t = time.perf_counter()
            tier.write_many([(0, k, data[i]) for i, k in enumerate(keys)])
            runs[f"{name}set"].append(_gbps(data.nbytes, time.perf_counter() - t))
            t = time.perf_counter()
            ok = tier.read_many([(0, k, outs[i]) for i, k in enumerate(keys)])
            runs[f"{name}get"].append(_gbps(data.nbytes, time.perf_counter() - t))
            assert all(ok)
        t = time.perf_counter()
        for i in range(pages):
            client.set(f"hybridkv-bench-naive:{i}", data[i].tobytes())
        runs["naive_set"].append(_gbps(data.nbytes, time.perf_counter() - t))
        t = time.perf_counter()
        for i in range(pages):
            client.get(f"hybridkv-bench-naive:{i}")
        runs["naive_get"].append(_gbps(data.nbytes, time.perf_counter() - t))
    for name in client.scan_iter(match="hybridkv-bench*"):
        client.delete(name)
    for tier in tiers.values():
        tier.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"page_bytes": page_bytes, "hiredis": HIREDIS_AVAILABLE,
            **{f"{k}_gbps": v for k, v in med.items()},
            "redis_benchmark": _redis_benchmark(url, page_bytes),
            "spread": {k: [min(v), max(v)] for k, v in runs.items()}}


def _redis_benchmark(url: str, value_bytes: int) -> dict | None:
    """The server's own client, pipelined, with about 2 GB per command: the wire ceiling."""
    from urllib.parse import urlsplit

    if shutil.which("redis-benchmark") is None:
        return None
    parts = urlsplit(url)
    requests = max(1000, 2 * 10**9 // value_bytes)
    proc = subprocess.run(
        ["redis-benchmark", "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379),
         "-t", "set,get", "-n", str(requests), "-d", str(value_bytes), "-c", "4", "-P", "16",
         "-q", "--csv"],
        capture_output=True, text=True, timeout=300)
    out = {"requests": requests}
    for line in proc.stdout.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells and cells[0] in ("SET", "GET"):
            out[f"{cells[0].lower()}_gbps"] = float(cells[1]) * value_bytes / GB
    return out if len(out) > 1 else None


def bench_hashing(tokens: int = 65536, block_tokens: int = 64, repeats: int = 20) -> dict:
    from hybridkv.core.keys import block_hashes

    ids = np.random.default_rng(0).integers(0, 150_000, tokens)
    seconds = []
    for _ in range(repeats):
        t = time.perf_counter()
        block_hashes(ids, block_tokens)
        seconds.append(time.perf_counter() - t)
    return {"tokens": tokens, "block_tokens": block_tokens, "ms": statistics.median(seconds) * 1000,
            "spread_ms": [min(seconds) * 1000, max(seconds) * 1000]}


def bench_hit_lookup(lengths: tuple[int, ...] = (16384, 131072), repeats: int = 20) -> list[dict]:
    """``Connector.begin`` on a prompt held wholly in RAM, with a filesystem tier attached vs
    without one (the ceiling): the disk must not be asked about what RAM already answers."""
    from hybridkv.cache import TieredCache
    from hybridkv.connector import Connector
    from hybridkv.tiers.filesystem import FilesystemTier

    B = 64
    layout = layout_from_dict({"model": "bench-hit", "block_tokens": B, "max_model_len": 1 << 20,
                               "groups": [{"id": 0, "kind": "attention", "page_bytes": 4096},
                                          {"id": 1, "kind": "state", "page_bytes": 65536}]})
    rows = []
    for n in lengths:
        ids = np.random.default_rng(n).integers(0, 150_000, n).tolist()
        store = tempfile.mkdtemp(prefix="hybridkv-bench-hit-")
        config = CacheConfig(block_tokens=B, ram_bytes=(n // B) * 4096 + 64 * 65536, reference_tokens=n)
        fs = FilesystemTier(store, layout, direct=False)
        timings = {}
        try:
            for name, secondaries in (("ram_only", []), ("with_fs", [fs])):
                with TieredCache(layout, config, secondaries=secondaries) as cache:
                    conn = Connector(cache)
                    req = conn.begin("fill", ids)
                    page0, page1 = np.zeros(4096, np.uint8), np.zeros(65536, np.uint8)
                    for b in range(len(req.keys)):
                        if conn.wants_block(req, b):
                            conn.offer_block(req, b, {0: page0})
                        if conn.wants_state(req, (b + 1) * B):
                            conn.offer_state(req, (b + 1) * B, {1: page1})
                    conn.finish(req)
                    cache.drain()    # timed lookups, not lookups racing the write-through threads
                    before = fs.stats["disk_lookups"]
                    seconds = []
                    for i in range(repeats):
                        t = time.perf_counter()
                        req = conn.begin(f"r{i}", ids)
                        seconds.append(time.perf_counter() - t)
                        assert req.hit_tokens > 0
                        conn.finish(req)
                    timings[name] = statistics.median(seconds)
                    timings[f"{name}_disk_lookups"] = (fs.stats["disk_lookups"] - before) / repeats
        finally:
            fs.close()
            shutil.rmtree(store, ignore_errors=True)
        rows.append({"prompt_tokens": n, "ram_only_ms": timings["ram_only"] * 1000,
                     "with_fs_ms": timings["with_fs"] * 1000,
                     "ratio": timings["with_fs"] / timings["ram_only"],
                     "disk_lookups_per_request": timings["with_fs_disk_lookups"]})
    return rows


# -- 3. restore vs recompute ------------------------------------------------------------------
def bench_restore(lengths: list[int], model: str = "tiny-hybrid", repeats: int = 3,
                  ram_dir: str | None = None) -> list[dict]:
    """Cold TTFT vs restore from RAM (same process) and from disk (fresh engine, empty RAM),
    with the RAM regions in ``ram_dir`` (default: the config's, /dev/shm).
    Disk restores alternate with raw reads of the same files, so the ceiling is sampled as
    often as the restore and a disk whose speed drifts moves both alike; which of the two
    goes first alternates too (this VM's disk reads bytes it read a moment ago faster). The
    disk, the noisiest, gets three times as many samples (this VM's disk moves ±10% from one
    restore to the next)."""
    from hybridkv.engine.engine import Engine

    rows = []
    for n in lengths:
        ids = np.random.default_rng(n).integers(3, 259, n).tolist()
        store = tempfile.mkdtemp(prefix="hybridkv-bench-restore-")
        config = CacheConfig(block_tokens=64, store=store, ram_bytes=64 * MiB, reference_tokens=max(n, 1024),
                             **({"ram_dir": ram_dir} if ram_dir else {}))
        try:
            cold_engine = Engine(model, config, use_cache=False)
            cold_engine.generate(ids[:64], 1)           # warm-up
            colds = [cold_engine.generate(ids, 4) for _ in range(repeats)]
            with Engine(model, config) as engine:
                engine.generate(ids, 4)
                rams = [engine.generate(ids, 4) for _ in range(repeats)]
            same, disks, raw_reads = _SamePages(Path(store)), [], []
            for r in range(3 * repeats):
                for name in _rotated(["raw", "disk"], r):
                    if name == "raw":
                        raw_reads.append(same.raw_read_gbps())
                        continue
                    with Engine(model, config) as engine:
                        disks.append(engine.generate(ids, 4))
            waits = _lookup_waits(cold_engine.layout, config, ids, repeats + 2)
            ceilings = {**same.facts(), "raw_read_same_pages_gbps": statistics.median(raw_reads),
                        "memcpy_same_pages_gbps": same.memcpy_gbps(5)}
        finally:
            shutil.rmtree(store, ignore_errors=True)
        cold_digest = colds[0].logits_digest
        ram_restore = statistics.median(r.restore_s for r in rams)
        fs_restore = statistics.median(r.restore_s for r in disks)
        rows.append({
            "prompt_tokens": n, "hit_tokens": rams[0].hit_tokens, "ram_dir": config.ram_dir,
            "cold_ttft_s": statistics.median(r.ttft_s for r in colds),
            "ram_ttft_s": statistics.median(r.ttft_s for r in rams),
            "fs_ttft_s": statistics.median(r.ttft_s for r in disks),
            "restored_bytes": rams[0].restored_bytes,
            "ram_restore_s": ram_restore, "fs_restore_s": fs_restore,
            "ram_restore_gbps": _gbps(rams[0].restored_bytes, ram_restore),
            "fs_restore_gbps": _gbps(disks[0].restored_bytes, fs_restore),
            "identical": all(r.logits_digest == cold_digest for r in rams + disks + colds),
            **waits,
            **ceilings,
            **_ttft_bounds(rams, disks, ceilings),
        })
    return rows


def _lookup_waits(layout, config: CacheConfig, ids: list[int], repeats: int) -> dict:
    """What a disk restore costs the thread that looks the prompt up (vLLM's scheduler, and
    every running request with it): the hit lookup and the reads (``Connector.load``) vs the
    hit lookup and the start of the reads (``start_load``, reads in the background). And
    what those background reads cost the next lookup: a second request's ``begin`` for the
    same prompt while the first one's reads run, vs the same ``begin`` on an idle cache
    (a lookup must not wait for the reader threads). Each in a fresh cache over the store,
    once its start-up scan is done; the medians in ms."""
    from hybridkv.cache import TieredCache
    from hybridkv.connector import Connector

    def wait_ms(background: bool) -> tuple[float, float]:
        with TieredCache(layout, config) as cache:
            for tier in cache.secondaries:
                tier.scanned.wait(60)
            conn = Connector(cache)
            t = time.perf_counter()
            req = conn.begin("bench", ids)
            looked_up = time.perf_counter()
            started = conn.start_load(req) if background else conn.load(req)
            ms = (time.perf_counter() - t) * 1e3
            lookup_ms = (looked_up - t) * 1e3
            if background:      # the reads are running: look the prompt up again meanwhile
                t = time.perf_counter()
                other = conn.begin("bench-next", ids)
                lookup_ms = (time.perf_counter() - t) * 1e3
                conn.finish(other)
            # (the views die when this call returns: the RAM they map is freed between two
            # samples, not inside the next one, where it cost 10 ms for 64 MiB)
            if started is None or conn.finish_load(req) is None:
                raise RuntimeError("the benchmark prompt did not restore from disk")
            conn.finish(req)
        return ms, lookup_ms

    inside, background = zip(*[(wait_ms(False), wait_ms(True)) for _ in range(repeats)], strict=True)
    return {"lookup_wait_inside_ms": statistics.median(ms for ms, _ in inside),
            "lookup_wait_background_ms": statistics.median(ms for ms, _ in background),
            "lookup_alone_ms": statistics.median(lookup for _, lookup in inside),
            "lookup_beside_reads_ms": statistics.median(lookup for _, lookup in background)}


def _ttft_bounds(rams: list, disks: list, ceilings: dict) -> dict:
    """The best TTFT a restore could reach: the restored bytes at the ceiling's bandwidth
    (memcpy from RAM, raw reads of the same page files from disk) plus the prefill that
    remains after the restore (measured in the same requests). TTFT / bound is 1.0 for a
    restore path that costs nothing beyond moving the bytes."""
    out = {}
    for name, runs, ceiling in (("ram", rams, "memcpy_same_pages_gbps"), ("fs", disks, "raw_read_same_pages_gbps")):
        prefill = statistics.median(r.ttft_s - r.restore_s for r in runs)
        out[f"{name}_prefill_after_restore_s"] = prefill
        out[f"{name}_ttft_bound_s"] = runs[0].restored_bytes / (ceilings[ceiling] * GB) + prefill
    return out


class _SamePages:
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
        return _gbps(sum(self.file_bytes), time.perf_counter() - t)

    def memcpy_gbps(self, repeats: int) -> float:
        src, dst = np.ones(sum(self.pages), np.uint8), np.empty(sum(self.pages), np.uint8)
        bounds = np.cumsum([0, *self.pages]).tolist()

        def copy() -> float:
            t = time.perf_counter()
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                np.copyto(dst[a:b], src[a:b])
            return time.perf_counter() - t

        return _gbps(sum(self.pages), _median(copy, repeats)[0])


def _page_spans(pack: Path) -> list[int]:
    """Bytes of each page in a pack (payload and padding)."""
    from hybridkv.tiers import packfile

    fd = os.open(pack, os.O_RDONLY)
    try:
        return [packfile.aligned(length) for length in packfile.read_table(fd)["length"].tolist()]
    finally:
        os.close(fd)


MANAGER_SLOTS = {False: (10_000, 200_000, 1_000_000), True: (10_000, 100_000)}


def bench_manager_size(slots: int, repeats: int, progress: Callable[[str], None]) -> dict:
    """hybridkv's pool, its pure-Python fallback and (when at hand) vLLM's manager at one size."""
    out: dict = {"slots": slots}
    for policy in ("lru", "arc"):
        progress(f"manager: {policy} on {slots:,} slots, compiled and pure Python")
        out[policy] = bench_manager.measure(slots, policy, repeats)
        out.setdefault("python", {})[policy] = bench_manager.measure(slots, policy, repeats, backend="python")
        progress(f"manager: vLLM's CPUOffloadingManager, {policy} on {slots:,} slots (if vLLM is at hand)")
        peer = bench_manager.measure_vllm(slots, policy, repeats)
        if peer is not None:
            out.setdefault("vllm", {})[policy] = peer
    return out


def run_bench(quick: bool = False, remote: str | None = None, manager_slots: int | None = None,
              progress: Callable[[str], None] = lambda _m: None, ram_dir: str | None = None) -> dict:
    started = time.perf_counter()
    out: dict = {"mode": "quick" if quick else "full", "machine": machine()}
    progress("tiers: RAM slots vs memcpy")
    out["ram"] = bench_ram(pages=32 if quick else 128)
    progress("tiers: filesystem vs raw disk")
    out["fs"] = bench_fs(pages=32 if quick else 128, repeats=3 if quick else 5)
    progress("tiers: filesystem batched reads (promotion path) vs raw reads of the same files")
    out["fs_batch"] = bench_fs_batch(total_bytes=(16 if quick else 64) * MiB, repeats=3 if quick else 9)
    progress("tiers: opening a large filesystem store")
    out["fs_startup"] = bench_fs_startup(20_000 if quick else 200_000)
    progress("tiers: opening a store of small pages in packs")
    out["fs_startup_packed"] = bench_fs_startup_packed(100_000 if quick else 1_000_000)
    if remote:
        progress("tiers: remote")
        out["remote"] = [bench_remote(remote, 64 * 1024, 512, repeats=3 if quick else 5),
                         bench_remote(remote, MiB, 64, repeats=3 if quick else 5)]
    progress("block-key hashing")
    out["hashing"] = bench_hashing()
    progress("hit lookup with a filesystem tier attached vs RAM only")
    out["hit_lookup"] = bench_hit_lookup(repeats=10 if quick else 20)
    out["manager"] = [bench_manager_size(n, 3 if quick else 5, progress)
                      for n in ([manager_slots] if manager_slots else MANAGER_SLOTS[quick])]
    progress("restore vs recompute")
    out["restore"] = bench_restore([1024, 4096] if quick else [1024, 4096, 16384, 32000], repeats=2 if quick else 3,
                                   ram_dir=ram_dir)
    out["seconds"] = time.perf_counter() - started
    return out


def machine() -> dict:
    import platform

    try:
        import torch
    except ImportError:               # the cache and the simulator run without it
        torch = None
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__ if torch else None, "numpy": np.__version__}
