"""The device check: the page copier on one device, in every cache layout vLLM uses, and
the reference engine restoring from RAM and disk on that device.

    python -m hybridkv.tools.gpu_check [--device cuda] [--pages 256] [--engine-tokens 4096,16384,32768]

For each physical layout (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC), a kernel split, a padded
state cache and two tensor-parallel ranks, it builds paged caches strided as vLLM builds them,
saves pages into a shared RAM region (registered with CUDA on a GPU), loads them into an empty
cache of another layout and checks every block bit for bit. It then times saves and loads of
``--pages`` pages against the ceiling of the same bytes: one torch copy between a contiguous
device tensor and pinned host memory. It prints one JSON summary; exit status 1 if any round
trip differs. Then the reference engine (``--model``, a built-in tiny hybrid) serves each
``--engine-tokens`` prompt cold, from RAM, and from disk in a fresh engine (a new RAM tier on
the same store): time to first token of each, and whether every logit is bit-identical to cold.
``--device cpu`` runs the same checks on CPU tensors (the test suite does, with small sizes, so
the check cannot rot). Needs torch, numpy and transformers: no vLLM, no network.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridkv.device.page_copy import PageCopier, block_bytes, fold_kernel_blocks
from hybridkv.ram.regions import SharedRegion

# vLLM's KVCacheLayout: the physical order of the logical [L, B, H, N, C] dims
LAYOUT_ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
                 "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def attention_caches(layout: str, layers: int, blocks: int, heads: int, tokens: int, width: int,
                     dtype=torch.float16, device="cpu", split: int = 1, seed: int = 0) -> list[torch.Tensor]:
    """``layers`` attention caches ``[B*split, H, N/split, C]`` over one buffer, with the
    strides vLLM gives ``layout`` (contents random, ``seed``)."""
    esz = torch.empty((), dtype=dtype).element_size()
    shape = (layers, blocks * split, heads, tokens // split, width * esz)
    order = LAYOUT_ORDERS[layout]
    strides, step = [0] * 5, 1
    for dim in reversed(order):
        strides[dim], step = step, step * shape[dim]
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (step,), dtype=torch.int8, generator=gen).to(device)
    five = torch.as_strided(raw, shape, strides)
    return [five[i].view(dtype) for i in range(layers)]


def state_caches(layers: int, blocks: int, real: int, padded: int, device="cpu", seed: int = 0) -> list[torch.Tensor]:
    """Mamba-style state caches as vLLM registers them: int8 ``[B, 1, 1, real]`` views whose
    block stride is the padded page, the layers one after another."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (layers * blocks * padded,), dtype=torch.int8, generator=gen).to(device)
    return [torch.as_strided(raw, (blocks, 1, 1, real), (padded, real, real, 1), i * blocks * padded)
            for i in range(layers)]


def _region(directory: Path, name: str, slots: int, page: int, device: torch.device) -> SharedRegion:
    from hybridkv.device.pinning import cuda_pin_hook

    return SharedRegion.create(directory / name, slots, page, cuda_pin_hook() if device.type == "cuda" else None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def round_trip(layout: str, load_layout: str, device: torch.device, directory: Path, split: int = 1,
               ranks: int = 1) -> bool:
    """Save every block of a cache in ``layout`` (``ranks`` slices) and load it into an empty
    cache in ``load_layout``: are all blocks bit-identical, and untouched blocks still zero?"""
    blocks, dims = 8, dict(layers=2, heads=2, tokens=16, width=32)
    sources = [[fold_kernel_blocks(t, blocks) for t in
                attention_caches(layout, blocks=blocks, device=device, split=split, seed=r, **dims)]
               for r in range(ranks)]
    slice_bytes = block_bytes(sources[0])
    region = _region(directory, f"rt-{layout}-{load_layout}-{split}-{ranks}", blocks, slice_bytes * ranks, device)
    ok = True
    try:
        order = list(range(blocks))
        for rank, views in enumerate(sources):
            PageCopier({0: views}, {0: region.page_bytes}, rank, ranks).save(0, region, order[::-1], order).wait()
        for rank, views in enumerate(sources):
            empty = [torch.zeros_like(t) for t in attention_caches(load_layout, blocks=blocks, device=device, **dims)]
            targets = [fold_kernel_blocks(t, blocks) for t in empty]
            half = order[: blocks // 2]
            PageCopier({0: targets}, {0: region.page_bytes}, rank, ranks).load(
                0, region, [blocks - 1 - b for b in half], half).wait()
            for src, dst in zip(views, targets, strict=True):
                src, dst = _bits(src), _bits(dst)
                ok &= bool(torch.equal(src[: blocks // 2], dst[: blocks // 2]))
                ok &= not bool(dst[blocks // 2:].count_nonzero())
    finally:
        region.close()
    return ok


def _bits(view: torch.Tensor) -> torch.Tensor:
    """A block view's bytes in logical order, one row a block (random bytes may be NaNs)."""
    return view.reshape(view.shape[0], -1).contiguous().view(torch.uint8)


def state_round_trip(device: torch.device, directory: Path) -> bool:
    """Padded state pages: only the real bytes travel, the padding is never written."""
    blocks, real, padded = 6, 96, 160
    src = state_caches(3, blocks, real, padded, device)
    region = _region(directory, "rt-state", blocks, 3 * real, device)
    try:
        PageCopier({1: src}, {1: region.page_bytes}).save(1, region, [5, 4], [1, 2]).wait()
        dst = state_caches(3, blocks, real, padded, device, seed=7)
        base = torch.as_strided(dst[0], (3 * blocks * padded,), (1,), 0).clone()
        PageCopier({1: dst}, {1: region.page_bytes}).load(1, region, [5, 4], [3, 0]).wait()
        after = torch.as_strided(dst[0], (3 * blocks * padded,), (1,), 0)
        changed = (after != base).nonzero().flatten().tolist()
        in_real = all(p % padded < real for p in changed)
        return in_real and all(torch.equal(s[1], d[3]) and torch.equal(s[2], d[0]) for s, d in zip(src, dst, strict=True))
    finally:
        region.close()


def _attention_blocks(blocks: int, device: torch.device) -> list[torch.Tensor]:
    """Block views of a small two-layer attention cache (random bytes)."""
    return [fold_kernel_blocks(t, blocks) for t in attention_caches(
        "LBNHC", blocks=blocks, device=device, layers=2, heads=8, tokens=16, width=128)]


def forward_reads_a_load(device: torch.device, directory: Path) -> bool:
    """A load within the step (``feeds_forward``): the engine's stream reads the blocks right
    after the call, with no wait on the transfer, as the forward does. On a GPU the copy is
    queued on its own stream; only the engine stream's wait on it makes this read the pages."""
    blocks = 256
    src = _attention_blocks(blocks, device)
    region = _region(directory, "forward", blocks, block_bytes(src), device)
    try:
        ids = list(range(blocks))
        PageCopier({0: src}, {0: region.page_bytes}).save(0, region, ids, ids).wait()
        dst = [torch.zeros_like(t) for t in src]
        PageCopier({0: dst}, {0: region.page_bytes}).load(0, region, ids, ids, feeds_forward=True)
        return all(bool(torch.equal(_bits(a), _bits(b))) for a, b in zip(src, dst, strict=True))
    finally:
        region.close()


def a_grown_save_buffer_outlives_its_transfer(device: torch.device, directory: Path) -> bool:
    """A save whose transfer to host is still running when the next, larger save grows the
    staging buffer: the engine then allocates and overwrites memory of that buffer's size at
    once. The buffer lives on the copy's stream, so the engine never gets the old memory while
    the transfer reads it; the first save's pages must land whole."""
    blocks = 512
    src = _attention_blocks(blocks, device)
    page = block_bytes(src)
    region = _region(directory, "grown", blocks, page, device)
    try:
        copier = PageCopier({0: src}, {0: page})
        first, rest = list(range(blocks // 4)), list(range(blocks // 4, blocks))
        early = copier.save(0, region, first, first)               # no wait: its DMA is queued
        late = copier.save(0, region, rest, rest)                  # a larger buffer replaces the first
        garbage = [torch.full((len(first) * page,), 0xA5, dtype=torch.uint8, device=device) for _ in range(4)]
        early.wait()
        late.wait()
        del garbage
        dst = [torch.zeros_like(t) for t in src]
        PageCopier({0: dst}, {0: page}).load(0, region, first, first).wait()
        return all(bool(torch.equal(_bits(a)[: len(first)], _bits(b)[: len(first)])) for a, b in zip(src, dst, strict=True))
    finally:
        region.close()


def _median_s(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(layout: str, device: torch.device, directory: Path, pages: int, repeats: int) -> dict:
    """Save and load GB/s of ``pages`` pages of a Qwen3-Next-like attention layer group
    (4 layers x 2 heads x 256 dims x 128 tokens, bf16: 1 MiB a page) against torch's own
    copy of the same bytes between a device tensor and pinned host memory."""
    views = [fold_kernel_blocks(t, pages) for t in attention_caches(
        layout, layers=4, blocks=pages, heads=2, tokens=128, width=512, dtype=torch.bfloat16, device=device)]
    page = block_bytes(views)
    region = _region(directory, f"bw-{layout}", pages, page, device)
    try:
        copier = PageCopier({0: views}, {0: page})
        ids = list(range(pages))
        save = _median_s(lambda: copier.save(0, region, ids, ids).wait(), repeats, device)
        load = _median_s(lambda: copier.load(0, region, ids, ids).wait(), repeats, device)
        flat = torch.empty(pages * page, dtype=torch.uint8, device=device)
        host = torch.empty(pages * page, dtype=torch.uint8, pin_memory=device.type == "cuda")
        d2h = _median_s(lambda: host.copy_(flat, non_blocking=True), repeats, device)
        h2d = _median_s(lambda: flat.copy_(host, non_blocking=True), repeats, device)
    finally:
        region.close()
    gbps = lambda s: round(pages * page / s / 1e9, 2)  # noqa: E731
    return {"layout": layout, "page_bytes": page, "pages": pages,
            "save_GBps": gbps(save), "load_GBps": gbps(load),
            "ceiling_d2h_GBps": gbps(d2h), "ceiling_h2d_GBps": gbps(h2d),
            "save_vs_ceiling": round(d2h / save, 3), "load_vs_ceiling": round(h2d / load, 3)}


def engine_restores(device: torch.device, lengths: list[int], model: str, repeats: int) -> list[dict]:
    """Per prompt length: cold, RAM and fresh-engine disk TTFT (medians) and bit-identity."""
    import numpy as np

    from hybridkv.config import CacheConfig
    from hybridkv.engine.engine import Engine

    rows = []
    for n in lengths:
        ids = np.random.default_rng(n).integers(3, 259, n).tolist()
        with tempfile.TemporaryDirectory(prefix="hybridkv-gpu-check-") as store:
            config = CacheConfig(block_tokens=64, store=store, ram_bytes=max(64 << 20, n * 8192),
                                 reference_tokens=n)
            with Engine(model, config, use_cache=False, device=str(device)) as cold_engine:
                cold_engine.generate(ids[:64], 1)                  # warm-up
                colds = [cold_engine.generate(ids, 4) for _ in range(repeats)]
            with Engine(model, config, device=str(device)) as engine:
                engine.generate(ids, 4)
                rams = [engine.generate(ids, 4) for _ in range(repeats)]
            disks = []
            for _ in range(repeats):
                with Engine(model, config, device=str(device)) as engine:
                    disks.append(engine.generate(ids, 4))
        ms = lambda results: round(1e3 * statistics.median(r.ttft_s for r in results), 2)  # noqa: E731
        digest = colds[0].logits_digest
        rows.append({"prompt_tokens": n, "hit_tokens": rams[0].hit_tokens,
                     "cold_ttft_ms": ms(colds), "ram_ttft_ms": ms(rams), "disk_ttft_ms": ms(disks),
                     "ram_speedup": round(ms(colds) / ms(rams), 2), "disk_speedup": round(ms(colds) / ms(disks), 2),
                     "loaded_from_disk": disks[0].loaded_pages.get("fs", 0) > 0,
                     "identical": all(r.logits_digest == digest for r in colds + rams + disks)})
    return rows


def run(device: torch.device, pages: int, repeats: int, lengths: list[int] = (), model: str = "tiny-hybrid") -> dict:
    out: dict = {"device": str(device), "torch": torch.__version__,
                 "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "round_trips": {}}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        directory = Path(tmp)
        layouts = list(LAYOUT_ORDERS)
        for i, layout in enumerate(layouts):       # load into the next layout: pages are layout-free
            out["round_trips"][f"{layout}->{layouts[(i + 1) % len(layouts)]}"] = round_trip(
                layout, layouts[(i + 1) % len(layouts)], device, directory)
        out["round_trips"]["LBNHC split 2->LBHNC"] = round_trip("LBNHC", "LBHNC", device, directory, split=2)
        out["round_trips"]["LBHNC 2 ranks"] = round_trip("LBHNC", "LBNHC", device, directory, ranks=2)
        out["round_trips"]["state, padded"] = state_round_trip(device, directory)
        out["round_trips"]["load read by the next forward"] = forward_reads_a_load(device, directory)
        out["round_trips"]["save buffer grown during a transfer"] = a_grown_save_buffer_outlives_its_transfer(
            device, directory)
        out["bandwidth"] = [bandwidth(layout, device, directory, pages, repeats) for layout in ("LBNHC", "LBHNC")]
    out["engine"] = engine_restores(device, list(lengths), model, repeats) if lengths else []
    out["ok"] = all(out["round_trips"].values()) and all(
        r["identical"] and r["loaded_from_disk"] for r in out["engine"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridkv.tools.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device (default: cuda where there is one)")
    parser.add_argument("--pages", type=int, default=256, help="pages timed per copy (1 MiB each; default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats, median reported (default 5)")
    parser.add_argument("--engine-tokens", default="4096,16384,32768",
                        help="prompt lengths of the engine restores, comma-separated; 0 skips them")
    parser.add_argument("--model", default="tiny-hybrid", help="built-in model of the engine restores")
    args = parser.parse_args(argv)
    try:
        lengths = [int(x) for x in args.engine_tokens.split(",") if int(x) > 0]
    except ValueError:
        parser.error(f"--engine-tokens {args.engine_tokens!r} is not a comma-separated list of integers")
    try:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("this torch sees no CUDA device")
    except RuntimeError as e:
        parser.error(f"--device {args.device}: {e}; use --device cpu for the dry run")
    if args.pages < 1 or args.repeats < 1:
        parser.error("--pages and --repeats must be at least 1")
    result = run(device, args.pages, args.repeats, lengths, args.model)
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
