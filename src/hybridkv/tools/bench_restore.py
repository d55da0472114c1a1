"""Restore vs recompute: TTFT of the default model cold, from RAM and from disk, against the
time the restore's bytes take to move (the bound); block-key hashing and hit lookups."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from hybridkv.config import CacheConfig
from hybridkv.core.layout import layout_from_dict
from hybridkv.tools.bench_common import GB, MiB, gbps
from hybridkv.tools.bench_tiers import SamePages, rotated


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
            same, disks, raw_reads = SamePages(Path(store)), [], []
            for r in range(3 * repeats):
                for name in rotated(["raw", "disk"], r):
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
            "ram_restore_gbps": gbps(rams[0].restored_bytes, ram_restore),
            "fs_restore_gbps": gbps(disks[0].restored_bytes, fs_restore),
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
