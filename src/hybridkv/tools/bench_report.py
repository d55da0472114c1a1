"""Turns ``hybridkv bench`` results into docs/benchmarks.md tables and PNG charts."""

from __future__ import annotations

from pathlib import Path

GiB = 1024**3


def _r(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def _table(add, title: str, header: str, align: str) -> None:
    """A section title, then a Markdown table's header row and alignment row."""
    add(f"### {title}\n")
    add(header)
    add(align)


def manager_table(mg: dict) -> list[str]:
    """hybridkv's pool (compiled, and its pure-Python fallback) and, where it ran, vLLM's
    manager on the same trace at one pool size, with ratios."""
    lines: list[str] = []
    add = lines.append
    add(f"### Manager operations per second ({mg['slots']:,} slots, one core, GC on, median)\n")
    add("| manager | lookups/s | store cycles/s | touches/s |")
    add("|---|---:|---:|---:|")
    fields = ("lookup_ops_per_s", "store_cycles_per_s", "touch_ops_per_s")
    peers = mg.get("vllm", {})

    def row(name, x):
        add(f"| {name} | " + " | ".join("not in this vLLM" if x[f] is None else f"{x[f]:,.0f}" for f in fields) + " |")

    for p in ("lru", "arc"):
        x, peer = mg[p], peers.get(p) or {}
        row(f"hybridkv {p}", x)
        if p in mg.get("python", {}):
            row(f"hybridkv {p}, pure-Python fallback", mg["python"][p])
        if "error" in peer:
            add(f"| vLLM {p} | not measured: {peer['error']} | | |")
        elif peer:
            row(f"vLLM CPUOffloadingManager {p}, same run", peer)
            add(f"| ratio hybridkv / vLLM {p} | " + " | ".join(
                "-" if peer[f] is None else f"{x[f] / peer[f]:.2f}x" for f in fields) + " |")
    if not peers:
        add("| vLLM | not measured in this run (no vLLM interpreter; see docs/vllm.md) | | |")
    add("")
    return lines


def tables(res: dict) -> str:
    m, lines = res["machine"], []
    add = lines.append
    add(f"Machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, torch {m['torch']}, "
        f"numpy {m['numpy']}. Mode: {res['mode']}, {res['seconds']:.0f} s.\n")
    ram = res["ram"]
    add("### RAM tier: copy into shared-region slots vs plain memcpy\n")
    add("| page | slot copy GB/s | memcpy GB/s | ratio | spread (slot / memcpy) |")
    add("|---|---:|---:|---:|---|")
    sp = ram["spread"]
    add(f"| {ram['page_bytes'] // 2**20} MiB | {_r(ram['copy_gbps'])} | {_r(ram['memcpy_gbps'])} | "
        f"{_r(ram['ratio'])} | {_r(sp['copy_gbps'][0])}–{_r(sp['copy_gbps'][1])} / "
        f"{_r(sp['memcpy_gbps'][0])}–{_r(sp['memcpy_gbps'][1])} |\n")
    if "first_copy_gbps" in ram:
        add(f"First copy into every slot of a new region (a store into slots never used before): "
            f"{_r(ram['first_copy_gbps'])} GB/s with the region's pages mapped ahead, "
            f"{_r(ram['first_copy_unmapped_gbps'])} GB/s where each 4 KiB page faults in as the copy "
            f"first touches it ({_r(ram['first_copy_gbps'] / ram['first_copy_unmapped_gbps'])}x).\n")
    if "arena_move" in res:
        mv = res["arena_move"]
        add(f"An arena move's copy ({mv['pages']} idle pages of {mv['page_bytes'] // 2**20} MiB relocated within "
            f"the arena, on the cache's thread before the store that asked for the room goes on): one thread "
            f"{mv['one_thread_ms']:.1f} ms ({_r(mv['one_thread_gbps'])} GB/s), {mv['threads']} threads "
            f"{mv['threaded_ms']:.1f} ms ({_r(mv['threaded_gbps'])} GB/s, {_r(mv['speedup'])}x); one memcpy of the "
            f"same bytes in one piece on one thread {mv['memcpy_ms']:.1f} ms ({_r(mv['memcpy_gbps'])} GB/s).\n")
    fs = res["fs"]
    add(f"### Filesystem tier vs the same files written and read raw ({fs['page_bytes'] // 2**20} MiB pages)\n")
    add("| mode | write GB/s | raw write | ratio | read GB/s | raw read | ratio |")
    add("|---|---:|---:|---:|---:|---:|---:|")
    for mode in ("buffered", "direct"):
        if mode in fs:
            f = fs[mode]
            add(f"| {mode} | {_r(f['write_gbps'])} | {_r(f['raw_write_gbps'])} | {_r(f['write_ratio'])} | "
                f"{_r(f['read_gbps'])} | {_r(f['raw_read_gbps'])} | {_r(f['read_ratio'])} |")
    add(f"\n`dd oflag=direct` with the same block size: {_r(fs.get('dd_write_gbps'))} GB/s write. "
        "Buffered reads come from the page cache (the pages were just written).\n")
    if "fs_batch" in res:
        _table(add, "Filesystem tier: batched reads as a promotion does them vs raw reads of the same files",
               "| page | pages | tier GB/s | raw read of the same files GB/s | ratio | "
               "raw read, one file per page GB/s | tier / one file per page |",
               "|---:|---:|---:|---:|---:|---:|---:|")
        for row in res["fs_batch"]:
            per_file = row.get("raw_read_file_per_page_gbps")
            gain = f"{row['read_gbps'] / per_file:.2f}x" if per_file else "-"
            add(f"| {row['page_bytes'] // 1024} KiB | {row['pages']} | {_r(row['read_gbps'])} | "
                f"{_r(row['raw_read_gbps'])} | {row['ratio']:.2f}x | {_r(per_file)} | {gain} |")
        add(f"\nAll read with 4 threads, {res['fs_batch'][0]['mode']} I/O; the tier also verifies every "
            "page. The pages are stored in packs (many pages a file, read in runs of up to 4 MiB "
            "straight into page-aligned destinations, as RAM slots are); the last column is the "
            "ceiling of one file per page, the layout pages had before packs.\n")
    stores = [(f"{st['pages']:,} page files", st) for st in [res.get("fs_startup")] if st]
    stores += [(f"{st['pages']:,} small pages in {st['packs']:,} packs", st) for st in [res.get("fs_startup_packed")] if st]
    if stores:
        _table(add, "Opening a store",
               "| store | serving after | packed pages served after | fully ordered after | "
               "raw scandir + lstat walk | ordered / raw walk | index bytes per page |",
               "|---|---:|---:|---:|---:|---:|---:|")
        for name, st in stores:
            packed = f"{st['packed_served_s']:.2f} s" if "packs" in st else "-"
            walk = f"{st['raw_walk_s']:.2f} s | {st['scan_ratio']:.2f}x" if "raw_walk_s" in st else "- | -"
            add(f"| {name} | {st['open_s'] * 1e3:.1f} ms | {packed} | {st['scanned_s']:.2f} s | {walk} | "
                f"{st['index_bytes_per_page']:.0f} |")
        add("\nThe scan runs in the background: lookups are served from the first millisecond. It reads "
            "each pack's table first (one read a pack) and serves the packed pages, then walks the page "
            "files (a key not yet indexed is a miss, looked for in the background) and orders everything by mtime. Directory "
            "caches are warm for both the scan and the raw walk.\n")
    if "remote" in res:
        _table(add, "Remote tier (Redis on loopback)", "| value size | | SET GB/s | GET GB/s |", "|---|---|---:|---:|")
        for r in res["remote"]:
            rb = r.get("redis_benchmark") or {}
            passes = f", {r['passes']} passes over {r['pages']} pages" if "passes" in r else ""
            rows = [(f"hybridkv: pipelines straight between the RAM slots and the socket, checked{passes}",
                     r["set_gbps"], r["get_gbps"])]
            if "redis_py_set_gbps" in r:
                rows.append(("hybridkv through redis-py (TLS and cluster URLs)",
                             r["redis_py_set_gbps"], r["redis_py_get_gbps"]))
            rows += [("naive per-key redis-py calls", r["naive_set_gbps"], r["naive_get_gbps"]),
                     (f"redis-benchmark -c {rb.get('clients', 4)} -P {rb.get('pipeline', 16)} -r {rb.get('keys', 1)}, "
                      f"{rb.get('requests', '?')} requests", rb.get("set_gbps"), rb.get("get_gbps"))]
            for label, set_gbps, get_gbps in rows:
                add(f"| {r['page_bytes'] // 1024} KiB | {label} | {_r(set_gbps)} | {_r(get_gbps)} |")
            if "ratios" in rb:
                add(f"| {r['page_bytes'] // 1024} KiB | ratio hybridkv / redis-benchmark, median of "
                    f"{rb['repeats']} repeats each timing both | {rb['ratios']['set']:.2f}x | {rb['ratios']['get']:.2f}x |")
            elif rb.get("set_gbps") and rb.get("get_gbps"):
                add(f"| {r['page_bytes'] // 1024} KiB | ratio hybridkv / redis-benchmark | "
                    f"{r['set_gbps'] / rb['set_gbps']:.2f}x | {r['get_gbps'] / rb['get_gbps']:.2f}x |")
        add(f"\nhiredis installed: {'yes' if res['remote'][0].get('hiredis') else 'no'} (redis-py's "
            "replies; the slot path parses the few bytes of each reply's header itself and reads the "
            "value into the slot).\n")
    if "hit_lookup" in res:
        _table(add, "Hit lookup: `Connector.begin` on a prompt held in RAM, filesystem tier attached vs not",
               "| prompt tokens | RAM only ms | with fs ms | ratio | disk lookups per request |",
               "|---:|---:|---:|---:|---:|")
        for row in res["hit_lookup"]:
            add(f"| {row['prompt_tokens']:,} | {_r(row['ram_only_ms'], 3)} | {_r(row['with_fs_ms'], 3)} | "
                f"{row['ratio']:.2f}x | {row['disk_lookups_per_request']:.0f} |")
        add("")
    h = res["hashing"]
    add(f"### Block keys\n\nHashing a {h['tokens']:,}-token prompt in {h['block_tokens']}-token blocks: "
        f"**{_r(h['ms'])} ms** (median of 20; {_r(h['spread_ms'][0])}–{_r(h['spread_ms'][1])} ms).\n")
    for size in res["manager"]:
        lines += manager_table(size)
    ram_dir = res["restore"][0].get("ram_dir", "/dev/shm") if res["restore"] else "/dev/shm"
    add(f"### Restore vs recompute (tiny-hybrid, fp32, 2 threads, block 64, RAM regions in `{ram_dir}`)\n")
    add("| prompt tokens | restored | cold TTFT s | RAM TTFT s | disk TTFT s | speed-up RAM / disk | "
        "restored MB | restore GB/s RAM / disk | identical |")
    add("|---:|---:|---:|---:|---:|---|---:|---|---|")
    for row in res["restore"]:
        add(f"| {row['prompt_tokens']} | {row['hit_tokens']} | {_r(row['cold_ttft_s'], 3)} | "
            f"{_r(row['ram_ttft_s'], 3)} | {_r(row['fs_ttft_s'], 3)} | "
            f"{row['cold_ttft_s'] / row['ram_ttft_s']:.1f}x / {row['cold_ttft_s'] / row['fs_ttft_s']:.1f}x | "
            f"{row['restored_bytes'] / 1e6:.1f} | {_r(row['ram_restore_gbps'])} / {_r(row['fs_restore_gbps'])} | "
            f"{'yes' if row['identical'] else 'NO'} |")
    if all("raw_read_same_pages_gbps" in row for row in res["restore"]):
        add("\nCeilings over the very files each restore read (page files and packs), same run; "
            f"raw reads {res['restore'][0].get('raw_read_mode', 'buffered')} with 4 threads, as the tier reads:\n")
        add("| prompt tokens | pages | page bytes | memcpy GB/s | RAM restore / memcpy | raw read GB/s | "
            "disk restore / raw read |")
        add("|---:|---:|---|---:|---:|---:|---:|")
        for row in res["restore"]:
            add(f"| {row['prompt_tokens']} | {row['pages_on_disk']} | "
                f"{', '.join(str(b) for b in row['page_bytes_on_disk'])} | {_r(row['memcpy_same_pages_gbps'])} | "
                f"{row['ram_restore_gbps'] / row['memcpy_same_pages_gbps']:.3f} | "
                f"{_r(row['raw_read_same_pages_gbps'])} | "
                f"{row['fs_restore_gbps'] / row['raw_read_same_pages_gbps']:.3f} |")
    if all("ram_ttft_bound_s" in row for row in res["restore"]):
        add("\nTTFT against its bound: the restored bytes at the ceiling above plus the prefill that "
            "remains after the restore (same requests); 1.00x = the restore costs only its bytes:\n")
        add("| prompt tokens | prefill after restore ms RAM / disk | RAM TTFT / bound | disk TTFT / bound |")
        add("|---:|---|---:|---:|")
        for row in res["restore"]:
            add(f"| {row['prompt_tokens']} | {row['ram_prefill_after_restore_s'] * 1e3:.1f} / "
                f"{row['fs_prefill_after_restore_s'] * 1e3:.1f} | "
                f"{row['ram_ttft_s'] / row['ram_ttft_bound_s']:.2f}x | {row['fs_ttft_s'] / row['fs_ttft_bound_s']:.2f}x |")
    add("\nThe restore path includes the hit lookup, pinning, the copy into torch tensors and "
        "rebuilding the model's cache object; disk restores also verify every page, and copy "
        "each batch of pages into the tensors as its read lands.\n")
    if all("lookup_wait_inside_ms" in row for row in res["restore"]):
        add("What a disk restore costs the thread that looks the prompt up (in vLLM: the scheduler, "
            "and every running request's next token), in a fresh cache over the store: the lookup "
            "with the reads inside it, as under vLLM's default failure policy, vs the lookup that "
            "only starts the reads (`kv_load_failure_policy: recompute`):\n")
        add("| prompt tokens | pages | reads inside the lookup ms | reads in the background ms | ratio |")
        add("|---:|---:|---:|---:|---:|")
        for row in res["restore"]:
            add(f"| {row['prompt_tokens']} | {row['pages_on_disk']} | {row['lookup_wait_inside_ms']:.1f} | "
                f"{row['lookup_wait_background_ms']:.1f} | "
                f"{row['lookup_wait_background_ms'] / row['lookup_wait_inside_ms']:.2f}x |")
        add("")
    if all("lookup_beside_reads_ms" in row for row in res["restore"]):
        add("What those background reads cost the next lookup (vLLM's scheduler looks up waiting "
            "requests while earlier ones load): `begin` of a second request for the same prompt "
            "while the first one's reads run, vs `begin` on an idle cache:\n")
        add("| prompt tokens | lookup, idle ms | lookup beside the reads ms | ratio |")
        add("|---:|---:|---:|---:|")
        for row in res["restore"]:
            add(f"| {row['prompt_tokens']} | {row['lookup_alone_ms']:.2f} | {row['lookup_beside_reads_ms']:.2f} | "
                f"{row['lookup_beside_reads_ms'] / row['lookup_alone_ms']:.2f}x |")
        add("")
    return "\n".join(lines) + "\n"


POLICIES_INTRO = """Token hit rate per RAM budget on the Qwen3-Next-80B-A3B layout (6 MiB of KV per 256
tokens, 74.25 MiB per state position), replayed through the real connector over a page-less
cache. `dense` keeps a state at every block; `vllm-align` one at each prompt's replay boundary
(vLLM's own hybrid caching); `semantic` adds junctions (a state where a later prompt's
attention reached deeper than any state); `semantic-tail` also keeps the state one block before
the replay boundary; `semantic-aligned` is `semantic-tail` until it has seen where prompts
diverge, then keeps each prompt's state at the deepest multiple of the chunk they diverge at
(without tail states when that chunk is longer than a block); `periodic-N` adds one every N
tokens to `semantic`, `aligned-periodic-N` to `semantic-aligned`; `aligned-periodic`
(hybridkv's default) is `aligned-periodic-16384` at these 256-token blocks while two shadows of
RAM find its periodic states pay for their bytes (`semantic-aligned` otherwise), with spare
states and the learned insertion; `marconi` is semantic admission with
FLOP-aware eviction (recency against recompute saved per byte, its weight tuned on the first
15% of the trace). The attention-only ceiling gives every byte to KV pages and has a state
everywhere for free: no state policy can beat it at that budget. The clairvoyant row keeps
the default's RAM but stores a state only where a later prompt of the trace resumes: what a
better choice of states could gain (not a strict bound: eviction still decides what stays).
Wrong hits are hits deeper than an independent index of the trace's earlier prompts allows;
they must be 0.

"""


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(res: dict, directory: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []


    rows = res["restore"]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    n = [r["prompt_tokens"] for r in rows]
    for key, label in (("cold_ttft_s", "cold (recompute)"), ("ram_ttft_s", "restore from RAM"),
                       ("fs_ttft_s", "restore from disk")):
        ax.plot(n, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.legend()
    paths.append(_save(fig, directory / "ttft_vs_prompt.png"))

    fs = res["fs"]
    bars = [("RAM slot copy", res["ram"]["copy_gbps"], res["ram"]["memcpy_gbps"]),
            ("fs write", fs["write_gbps"], fs["raw_write_gbps"]),
            ("fs read", fs["read_gbps"], fs["raw_read_gbps"])]
    if "remote" in res:
        r = res["remote"][-1]
        bars += [("remote SET", r["set_gbps"], (r.get("redis_benchmark") or {}).get("set_gbps") or r["set_gbps"]),
                 ("remote GET", r["get_gbps"], (r.get("redis_benchmark") or {}).get("get_gbps") or r["get_gbps"])]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    x = range(len(bars))
    ax.bar([i - 0.2 for i in x], [b[1] for b in bars], width=0.4, label="hybridkv")
    ax.bar([i + 0.2 for i in x], [b[2] for b in bars], width=0.4, label="ceiling (same run)")
    ax.set_xticks(list(x), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("GB/s")
    ax.legend()
    paths.append(_save(fig, directory / "throughput_vs_ceiling.png"))
    return paths


INTRO = """# Benchmarks

Generated by `bash scripts/bench.sh` (this run: about {minutes} minutes; `--quick` takes under
two) from `docs/bench.json`. How each figure is measured, against which ceiling, and how to read
the tables: [reading_benchmarks.md](reading_benchmarks.md).

"""

CHARTS = """
## Charts

![token hit rate vs RAM budget per state policy](img/policies.png)

![TTFT vs prompt length](img/ttft_vs_prompt.png)

![throughput vs ceiling](img/throughput_vs_ceiling.png)
"""


def vllm_table(results: dict) -> str:
    """The TTFT table of ``hybridkv.tools.bench_vllm`` results."""
    m = results.get("machine")   # runs before 2026-12-05 did not record it
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores; vLLM {m['vllm']}, torch {m['torch']}.\n"] if m else []
    lines += ["| family | prompt | vLLM cold | vLLM own prefix cache | hybridkv cold | hybridkv RAM "
             "| hybridkv disk (new process) | speed-up RAM / disk vs cold | RAM / vLLM's own, one process "
             "| disk / RAM, one process |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(x):
        return "-" if x is None else f"{x['ttft_s'] * 1000:.0f} ms ({x['cached']:.0f} cached)"

    def ratio(a, b, paired=None):
        if paired is not None:       # each prompt's two requests back to back (newer runs)
            return f"{paired:.2f}x"
        return f"{a['ttft_s'] / b['ttft_s']:.2f}x" if a and b and b["cached"] else "-"

    for fam in results["families"]:
        for r in fam["rows"]:
            cold, ram, disk = r["vllm_cold"], r["hybridkv_ram"], r["hybridkv_disk"]
            speed = (f"{cold['ttft_s'] / ram['ttft_s']:.1f}x / {cold['ttft_s'] / disk['ttft_s']:.1f}x"
                     if cold and ram and disk else "-")
            # the ratios compare runs in one process where the run has them (newer runs)
            own, ram_beside = r.get("vllm_local_beside_ram", r["vllm_local"]), r.get("hybridkv_ram_beside_disk", ram)
            if not (r["vllm_local"] and r["vllm_local"]["cached"]):
                own = None               # stock vLLM's own cache found nothing: no ratio to give
            lines.append(f"| {fam['family']} | {r['tokens']:,} | {cell(cold)} | {cell(r['vllm_local'])} | "
                         f"{cell(r['hybridkv_cold'])} | {cell(ram)} | {cell(disk)} | {speed} | "
                         f"{ratio(ram, own, r.get('ram_over_own_paired'))} | "
                         f"{ratio(disk, ram_beside, r.get('disk_over_ram_paired'))} |")
    lines += _background_reads_table(results)
    lines.append(f"\nvLLM's OffloadingConnector on this build: {results['offloading']}")
    return "\n".join(lines)


def _background_reads_table(results: dict) -> list[str]:
    """Disk restores with the reads inside hybridkv's lookup vs in the background: TTFT, and
    how long vLLM's scheduler (every running request with it) waited in the lookup."""
    rows = [(fam["family"], r) for fam in results["families"] for r in fam["rows"]
            if r.get("hybridkv_disk_async") and r["hybridkv_disk"] and "match_ms" in r["hybridkv_disk"]]
    if not rows:
        return []
    lines = ["\nDisk restores in a new process, the reads inside the lookup (vLLM's default failure "
             "policy) vs in the background (`kv_load_failure_policy: recompute`); the lookup is "
             "what vLLM's scheduler, and every running request with it, waits for:\n",
             "| family | prompt | TTFT, reads in the lookup | scheduler waited | TTFT, reads in the "
             "background | scheduler waited | wait ratio | disk - RAM TTFT | of it, the longer lookup |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for family, r in rows:
        sync, bg = r["hybridkv_disk"], r["hybridkv_disk_async"]
        ram = r.get("hybridkv_ram_beside_disk", r["hybridkv_ram"])
        gap = longer = "-"
        if ram and "match_ms" in ram:
            gap = f"{(sync['ttft_s'] - ram['ttft_s']) * 1000:.1f} ms"
            longer = f"{sync['match_ms'] - ram['match_ms']:.1f} ms"
        lines.append(f"| {family} | {r['tokens']:,} | {sync['ttft_s'] * 1000:.0f} ms | {sync['match_ms']:.1f} ms | "
                     f"{bg['ttft_s'] * 1000:.0f} ms | {bg['match_ms']:.1f} ms | "
                     f"{bg['match_ms'] / sync['match_ms']:.2f}x | {gap} | {longer} |")
    lines.append("\nThe last two columns: what a disk restore adds to a RAM hit of the same prompt in the "
                 "same process, and how much of it is the longer lookup (the reads into RAM). The first "
                 "request of a process also loads in a step of its own (no worker has mapped the RAM "
                 "regions yet); later ones load within the step that runs them.")
    return lines


def vllm_summary(results: dict) -> str:
    """One generated line per family: the speed-up ranges over the prompt lengths of this run."""
    lines = []
    for fam in results["families"]:
        rows = [r for r in fam["rows"] if r["vllm_cold"] and r["hybridkv_ram"] and r["hybridkv_disk"]]
        if not rows:
            continue
        ram = [r["vllm_cold"]["ttft_s"] / r["hybridkv_ram"]["ttft_s"] for r in rows]
        disk = [r["vllm_cold"]["ttft_s"] / r["hybridkv_disk"]["ttft_s"] for r in rows]
        own = [r["vllm_local"]["cached"] for r in rows if r["vllm_local"]]
        note = "; vLLM's own prefix cache found nothing on a repeat" if own and not any(own) else ""
        lines.append(f"- {fam['family']}: {min(ram):.1f}-{max(ram):.1f}x faster than cold from RAM, "
                     f"{min(disk):.1f}-{max(disk):.1f}x from disk in a new process{note}.")
    return "\n".join(lines)


def gpu_section(summary: dict | None) -> str:
    """The device check's summary (``docs/gpu_check.json``), or what is missing."""
    lines = ["\n### GPU (`python -m hybridkv.tools.gpu_check`, `docs/gpu_check.json`)\n"]
    if summary is None:
        return "\n".join(lines + [
            "Not run yet: no GPU machine was available while the copy path was built. "
            "`bash scripts/gpu_check.sh` runs it on one (every vLLM cache layout round-tripped "
            "bit for bit, save/load GB/s against torch's pinned copy of the same bytes, the "
            "reference engine's cold/RAM/disk TTFT); put its JSON in `docs/gpu_check.json` and "
            "regenerate this page.\n"])
    lines.append(f"Card: {summary['card']}, torch {summary['torch']}. Round trips bit-identical: "
                 f"{sum(summary['round_trips'].values())} of {len(summary['round_trips'])}.\n")
    lines += ["| layout | page | save GB/s | vs pinned D2H | load GB/s | vs pinned H2D |",
              "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {b['layout']} | {b['page_bytes'] >> 10} KiB | {b['save_GBps']} | {b['save_vs_ceiling']:.2f}x | "
              f"{b['load_GBps']} | {b['load_vs_ceiling']:.2f}x |" for b in summary["bandwidth"]]
    if summary.get("engine"):
        lines += ["", "| prompt | cold TTFT | RAM TTFT | disk TTFT (fresh engine) | identical |",
                  "|---:|---:|---:|---:|---|"]
        lines += [f"| {r['prompt_tokens']:,} | {r['cold_ttft_ms']} ms | {r['ram_ttft_ms']} ms "
                  f"({r['ram_speedup']}x) | {r['disk_ttft_ms']} ms ({r['disk_speedup']}x) | {r['identical']} |"
                  for r in summary["engine"]]
    return "\n".join(lines) + "\n"


def write_page(results_path: str, page_path: str) -> None:
    import json

    res = json.loads(Path(results_path).read_text())
    text = INTRO.format(minutes=max(1, round(res["seconds"] / 60))) + "## Results\n\n" + tables(res)
    through_vllm = Path(results_path).with_name("bench_vllm.json")
    if through_vllm.exists():
        vllm = json.loads(through_vllm.read_text())
        text += ("\n### Through stock vLLM (`docs/bench_vllm.json`)\n\n" + vllm_table(vllm)
                 + "\n\n" + vllm_summary(vllm) + "\n")
    load = Path(results_path).with_name("bench_vllm_load.json")
    if load.exists():
        from hybridkv.tools.bench_vllm_load import table as load_table

        res_load = json.loads(load.read_text())
        text += ("\n### Serving under load (`python -m hybridkv.tools.bench_vllm_load`, `docs/bench_vllm_load.json`)\n\n"
                 f"`vllm serve` ({res_load['family']}, one worker) without and with hybridkv "
                 f"({res_load.get('tiers', 'RAM and a disk store')}), {res_load['clients']} concurrent streaming clients, {res_load['output_tokens']} "
                 "output tokens a request. `unique`: no prompt repeats (what a miss costs); `reuse`: shared "
                 "system prompts and multi-turn sessions.\n\n" + load_table(res_load) + "\n")
    policies = Path(results_path).with_name("bench_policies.json")
    if policies.exists():
        from hybridkv.tools.bench_policies import report as policies_report

        text += ("\n### State policies on workloads and traces (`python -m hybridkv.tools.bench_policies`, "
                 "`docs/bench_policies.json`, chart `docs/img/policies.png`)\n\n"
                 + POLICIES_INTRO + policies_report(json.loads(policies.read_text())) + "\n")
    lookup = Path(results_path).with_name("bench_lookup.json")
    if lookup.exists():
        from hybridkv.tools.bench_lookup import table as lookup_table

        text += ("\n### Lookups on the scheduler thread (`python -m hybridkv.tools.bench_lookup`, "
                 "`docs/bench_lookup.json`)\n\n" + lookup_table(json.loads(lookup.read_text())) + "\n")
    gpu = Path(results_path).with_name("gpu_check.json")
    text += gpu_section(json.loads(gpu.read_text()) if gpu.exists() else None)
    Path(page_path).write_text(text + CHARTS)


if __name__ == "__main__":
    import sys

    write_page(sys.argv[1], sys.argv[2])
