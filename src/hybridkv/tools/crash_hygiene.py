"""Crash hygiene, measured with real processes: what kill -9, a full disk, a read-only store
and a frozen Redis do to the cache.

Each scenario prints one row and a verdict; every verdict is a rule the design promises
(``docs/crash_hygiene.md`` holds the table of the last full run):

- *kill -9 during write storms*: two writer processes store overlapping pages and are killed
  at random moments; the next start must serve 0 corrupt pages and 0 phantom hits (indexed but
  unservable), keep every acknowledged page, and reclaim the dead writers' temp files.
- *RAM regions*: ``ram_dir`` (a directory on ``/dev/shm``) is empty after every clean exit;
  regions left by kill -9 are reaped by the next start.
- *full disk* / *read-only store* (a small tmpfs, mounted for the run; needs root): the engine
  keeps serving with output identical to a cold run and says so in one log line.
- *Redis stopped with SIGSTOP*: requests are abandoned to recompute (none waits more than ten
  times the configured timeout), output identical, one log line while it is stopped (and at
  most an "is back" line once it resumes). Whether the wait stayed within 1.5x the timeout is a
  figure beside the verdict: a loaded machine stretches it past that where the cache did
  nothing wrong.

usage: python -m hybridkv.tools.crash_hygiene [--loops N] [--json] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from hybridkv.core.layout import layout_from_dict
from hybridkv.tiers.admin import verify_store
from hybridkv.tiers.filesystem import FilesystemTier

LAYOUT = layout_from_dict({
    "model": "crash-hygiene", "block_tokens": 16, "max_model_len": 4096,
    "groups": [{"id": 0, "kind": "attention", "page_bytes": 4096},
               {"id": 1, "kind": "state", "page_bytes": 65536}],
})
KEYS = 400                       # the writers' shared key space: they overwrite each other's pages
PROMPT_TOKENS = 700


def expected_page(group: int, key: bytes) -> np.ndarray:
    """Every writer stores the same bytes for a key, as engines do for the same prefix."""
    seed = int.from_bytes(key, "big") * 2 + group
    return np.random.default_rng(seed).integers(0, 256, LAYOUT.group(group).page_bytes, dtype=np.uint8)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _child(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridkv.tools.crash_hygiene", *map(str, args)],
                            stdout=subprocess.PIPE, text=True, **kwargs)


# -- child processes --------------------------------------------------------------------------
def _writer(store: str, seed: str, ack_path: str) -> None:
    """Store random pages in batches through the tier's I/O threads until killed; one line per
    acknowledged page, written with one ``write`` so a kill cannot leave half a line."""
    rng = random.Random(int(seed))
    tier = FilesystemTier(store, LAYOUT, direct=False)
    ack = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    print("ready", flush=True)
    while True:
        batch = [(g, _key(rng.randrange(KEYS))) for g in (0, 1) for _ in range(4)]
        futures = tier.submit_writes([(g, k, expected_page(g, k)) for g, k in batch])
        tier.flush()                            # the batch is complete: write it now
        done = [f"{g} {k.hex()}\n" for (g, k), f in zip(batch, futures, strict=True) if f.result()]
        if done:
            os.write(ack, "".join(done).encode())


def _ram_user(ram_dir: str, how: str) -> None:
    """Open a cache with RAM regions in ``ram_dir``, store a page, then exit cleanly or hang."""
    from hybridkv.cache import TieredCache, store_pages
    from hybridkv.config import CacheConfig

    config = CacheConfig(block_tokens=16, ram_bytes="8MiB", ram_dir=ram_dir)
    with TieredCache(LAYOUT, config) as cache:
        store_pages(cache, {g: [(_key(1), expected_page(g, _key(1)))] for g in (0, 1)})
        cache.poll()
        print("ready", flush=True)
        if how == "hang":
            time.sleep(600)


# -- scenarios --------------------------------------------------------------------------------
def kill9_writers(loops: int, work: Path) -> dict:
    store, rng = work / "store", random.Random(0)
    totals = Counter(dict.fromkeys(("acked_writes", "pages_served", "corrupt_served", "phantom_hits",
                                    "acked_pages_lost", "orphans_reclaimed", "temp_files_left"), 0))
    for loop in range(loops):
        acks = [work / f"acks-{loop}-{i}" for i in range(2)]
        writers = [_child("_writer", store, 2 * loop + i, acks[i]) for i in range(2)]
        for w in writers:
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError("a writer did not start")
        time.sleep(rng.uniform(0.05, 0.4))
        for w in writers:                       # staggered: one dies while the other writes on
            w.send_signal(signal.SIGKILL)
            time.sleep(rng.uniform(0, 0.05))
        for w in writers:
            w.wait()
        acked = {(int(g), bytes.fromhex(k)) for a in acks for g, k in
                 (line.split() for line in a.read_text().splitlines())}
        totals["acked_writes"] += sum(len(a.read_text().splitlines()) for a in acks)

        tier = FilesystemTier(store, LAYOUT, direct=False)       # the next start
        tier.wait_scanned()                                     # it reclaims orphans as it scans
        totals["orphans_reclaimed"] += tier.stats["orphans_removed"]
        totals["temp_files_left"] += sum(1 for _ in tier.namespace.rglob("*.tmp"))
        totals["acked_pages_lost"] += sum(not tier.contains(g, k) for g, k in acked)
        for g in (0, 1):
            for i in range(KEYS):
                k = _key(i)
                if not tier.contains(g, k):
                    continue
                out = np.empty(LAYOUT.group(g).page_bytes, np.uint8)
                if not tier.read(g, k, out):
                    totals["phantom_hits"] += 1
                elif not np.array_equal(out, expected_page(g, k)):
                    totals["corrupt_served"] += 1
                else:
                    totals["pages_served"] += 1
        totals["corrupt_detected"] += tier.stats["corrupt"]
        tier.close()
    totals["verify_corrupt"] = verify_store(store, progress=False)["corrupt"]
    ok = all(totals[k] == 0 for k in ("phantom_hits", "corrupt_served", "acked_pages_lost",
                                     "temp_files_left", "verify_corrupt"))
    return {"scenario": "kill -9 during write storms (2 writers)", "loops": loops, **totals, "ok": ok}


def ram_regions(loops: int) -> dict:
    ram_dir = Path(tempfile.mkdtemp(prefix="hybridkv-hygiene-", dir="/dev/shm"))
    try:
        left_after_clean = 0
        for _ in range(loops):
            proc = _child("_ram", ram_dir, "exit")
            proc.communicate()
            left_after_clean += len(list(ram_dir.iterdir()))
        for _ in range(loops):
            proc = _child("_ram", ram_dir, "hang")
            proc.stdout.readline()
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        left_by_kill = len(list(ram_dir.iterdir()))
        _child("_ram", ram_dir, "exit").communicate()        # the next start reaps, then exits
        left_after_restart = len(list(ram_dir.iterdir()))
    finally:
        shutil.rmtree(ram_dir, ignore_errors=True)
    return {"scenario": "RAM regions in /dev/shm", "loops": loops,
            "files_left_after_clean_exits": left_after_clean,
            "files_left_by_kill9": left_by_kill, "files_left_after_next_start": left_after_restart,
            "ok": left_after_clean == 0 and left_by_kill > 0 and left_after_restart == 0}


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 250) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def _requests(path: Path, count: int) -> Path:
    with open(path, "w") as f:
        for ids in _prompts(count):
            f.write(json.dumps({"prompt_ids": ids, "max_new_tokens": 4}) + "\n")
    return path


def _generate(requests: Path, *flags: str) -> tuple[list[dict], list[str]]:
    """One engine process over the requests: its results and its own log lines."""
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "generate", "--requests", str(requests),
                           "--json", *flags], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"generate {' '.join(flags)} failed: {proc.stderr.strip()}")
    lines = [line.replace(str(requests.parent), "$WORK") for line in proc.stderr.splitlines()
             if line.startswith("hybridkv")]
    return [json.loads(line) for line in proc.stdout.splitlines()], lines


def _digests(results: list[dict]) -> list[str]:
    return [r["logits_digest"] for r in results]


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _can_mount(work: Path) -> bool:
    try:
        with _tmpfs(work / "probe", "64k"):
            return True
    except (subprocess.CalledProcessError, FileNotFoundError):
        return False


def full_disk_and_read_only(work: Path, cold: list[str], requests: Path) -> list[dict]:
    if not _can_mount(work):
        reason = "not run: mounting a tmpfs needs root"
        return [{"scenario": s, "ok": None, "note": reason} for s in ("full disk", "read-only store")]
    rows = []
    with _tmpfs(work / "small", "1m") as small:   # room for a few pages of the first prompt only
        results, lines = _generate(requests, "--store", str(small / "kv"), "--ram-bytes", "4MiB")
        rows.append({"scenario": "full disk (1 MiB tmpfs)", "requests": len(results),
                     "identical_to_cold": _digests(results) == cold, "log_lines": len(lines),
                     "log": lines[0] if lines else "",
                     "ok": _digests(results) == cold and len(lines) == 1 and "No space" in lines[0]})
    with _tmpfs(work / "ro", "64m") as ro:
        _generate(requests, "--store", str(ro / "kv"))
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True, capture_output=True)
        results, lines = _generate(requests, "--store", str(ro / "kv"))
        hits = sum(r["hit_tokens"] for r in results)
        rows.append({"scenario": "read-only store (tmpfs remounted ro)", "requests": len(results),
                     "hit_tokens": hits, "identical_to_cold": _digests(results) == cold,
                     "log_lines": len(lines), "log": lines[0] if lines else "",
                     "ok": _digests(results) == cold and hits > 0 and len(lines) == 1
                     and "read-only" in lines[0]})
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _WarningCount(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def redis_sigstop(requests_count: int, timeout_s: float = 0.3) -> dict:
    """A server that freezes mid-run (after the engine started and served a hit from it)."""
    from hybridkv.config import CacheConfig
    from hybridkv.engine.engine import Engine

    scenario = f"Redis stopped with SIGSTOP mid-run (timeout {timeout_s} s)"
    if not shutil.which("redis-server"):
        return {"scenario": scenario, "ok": None, "note": "not run: no redis-server"}
    prompts = _prompts(requests_count + 1)
    with Engine(use_cache=False) as cold_engine:
        cold = [cold_engine.generate(ids, 4) for ids in prompts]
    port = _free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)
    warnings = _WarningCount()
    logging.getLogger("hybridkv").addHandler(warnings)
    try:
        for _ in range(100):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.1):
                break
            time.sleep(0.05)
        config = CacheConfig(remote=f"redis://127.0.0.1:{port}/0", remote_timeout_s=timeout_s)
        with Engine(config=config) as filler:
            for ids in prompts:
                filler.generate(ids, 4)
        with Engine(config=config) as engine:        # a fresh RAM tier: every hit is remote
            first = engine.generate(prompts[0], 4)
            server.send_signal(signal.SIGSTOP)
            stalled = [engine.generate(ids, 4) for ids in prompts[1:]]
            while_stopped = list(warnings.lines)
            server.send_signal(signal.SIGCONT)
    finally:
        logging.getLogger("hybridkv").removeHandler(warnings)
        server.kill()
        server.wait()
    after_resume = warnings.lines[len(while_stopped):]
    extra = [r.ttft_s - c.ttft_s for r, c in zip(stalled, cold[1:], strict=True)]
    identical = [r.logits_digest for r in [first, *stalled]] == [c.logits_digest for c in cold]
    return {"scenario": scenario, "requests": len(prompts), "remote_hit_before_stop": first.hit_tokens,
            "hit_tokens_while_stopped": sum(r.hit_tokens for r in stalled),
            "identical_to_cold": identical, "max_extra_ttft_s": round(max(extra), 3),
            "total_extra_s": round(sum(extra), 3), "log_lines": len(while_stopped),
            "log": while_stopped[0] if while_stopped else "",
            # after SIGCONT a write-through may reach the server before the engine closes:
            # "is back" is then the one further line allowed
            "after_resume": after_resume, "stall_within_timeout": max(extra) <= timeout_s * 1.5,
            "ok": identical and first.hit_tokens > 0 and max(extra) <= 10 * timeout_s and len(while_stopped) == 1
            and all("is back" in line for line in after_resume)}


def run(loops: int, requests_count: int = 4) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="hybridkv-hygiene-") as tmp:
        work = Path(tmp)
        rows = [kill9_writers(loops, work), ram_regions(max(2, loops // 4))]
        requests = _requests(work / "requests.jsonl", requests_count)
        cold, _ = _generate(requests, "--no-cache")
        rows += full_disk_and_read_only(work, _digests(cold), requests)
        rows.append(redis_sigstop(requests_count))
    return rows


def markdown(rows: list[dict], loops: int) -> str:
    out = ["# Crash hygiene", "",
           f"Measured by `python -m hybridkv.tools.crash_hygiene --loops {loops}` "
           "(real processes, real files, a real tmpfs and redis-server). "
           "`ok` is the verdict of the rules in the tool's docstring.", "",
           "- *acked writes*: pages a writer's `write` reported stored before it was killed; "
           "*acked pages lost* counts those missing at the next start (a kill -9 is a process "
           "crash: the kernel keeps what was written, so nothing acknowledged may vanish).",
           "- *corrupt served*: a page read back as a hit whose bytes differ from what was written; "
           "*phantom hits*: pages the index holds that cannot be read; *corrupt detected*: pages "
           "that failed their checksum and were quarantined instead of served.",
           "- *orphans reclaimed*: temp files of killed writers removed by the next start; "
           "*temp files left* after it.",
           "- RAM regions: each clean exit must leave `ram_dir` empty; a kill -9 leaves its region "
           "and lease, which the next start reaps (only after taking the dead owner's lock).",
           "- Full disk / read-only: every request's logits equal a cold run's (sha256 digests), "
           "with one log line. Frozen Redis: *max extra ttft* is the worst TTFT over a cold run "
           "of the same prompt once the server stopped answering; *stall within timeout*: it stayed "
           "within 1.5x the configured timeout (a figure, not part of the verdict).", "",
           "| scenario | figures | ok |", "|---|---|---|"]
    for row in rows:
        figures = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in row.items()
                            if k not in ("scenario", "ok", "log"))
        if row.get("log"):
            figures += f"; log: `{row['log']}`"
        out.append(f"| {row['scenario']} | {figures} | {'yes' if row['ok'] else row['ok']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_writer":
        _writer(*argv[1:])
        return 0
    if argv and argv[0] == "_ram":
        _ram_user(*argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m hybridkv.tools.crash_hygiene",
                                     description="kill -9, full disk, read-only and frozen-Redis checks")
    parser.add_argument("--loops", type=int, default=20, help="kill -9 rounds (default 20)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.loops < 1:
        parser.error("--loops must be at least 1")
    rows = run(args.loops)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(markdown(rows, args.loops))
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, args.loops))
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
