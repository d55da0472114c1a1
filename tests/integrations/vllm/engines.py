"""Helpers of the vLLM tests: prompts, one engine per child process, stored page files."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from hybridkv.core.keys import block_hashes
from hybridkv.integrations.vllm.tiny_models import dtype_of
from hybridkv.tiers import packfile, pagefile
from hybridkv.tools.vllm_run import cpu_threads_bind

ENGINE_TIMEOUT_S = 600


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def engine_env(in_process: bool = False, tp: int = 1) -> dict:
    """The environment of an engine process: a 1 GiB KV cache, plenty for the tiny models.

    ``in_process`` runs vLLM's engine core inside that process instead of a child of it: the
    child re-imports vLLM and torch, 21 s per engine start against 9 s on this machine. The
    scheduler and worker halves of the connector still talk only through vLLM's metadata and the
    shared regions; ``vllm serve`` (test_vllm_serve) keeps the separate-process layout."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tp > 1:     # one core per worker: vLLM's CPU build refuses to share cores between ranks
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(tp)
    return env


def run_engine(model_dir: Path, family: str, connector: dict | None, requests: list[dict],
               workdir: Path, name: str, transfer: dict | None = None, tp: int = 1,
               kv_cache_dtype: str | None = None, max_lora_rank: int | None = None) -> dict:
    """One fresh vLLM engine process; returns its results and the connector's stats file.
    ``transfer``: more KVTransferConfig fields (kv_load_failure_policy); ``tp``: tensor-parallel
    workers; ``kv_cache_dtype``: vLLM's (fp8_e4m3, fp8_e5m2); ``max_lora_rank``: LoRA on (requests
    then name an adapter, ``"lora": [name, id, path]``)."""
    stats = Path(connector.get("stats_file", workdir / f"{name}-stats.json")) if connector else None
    if connector is not None:
        connector = {**connector, "stats_file": str(stats)}
    job = {"model": str(model_dir), "dtype": dtype_of(family), "connector": connector,
           "requests": requests, "max_tokens": 8, "transfer": transfer or {}, "tensor_parallel_size": tp,
           "kv_cache_dtype": kv_cache_dtype, "max_lora_rank": max_lora_rank}
    path = workdir / f"{name}-job.json"
    path.write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, "-m", "hybridkv.tools.vllm_run", str(path)],
                          capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S,
                          env=engine_env(in_process=True))
    (workdir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("HYBRIDKV_RESULT ")), None)
    assert proc.returncode == 0 and line, f"engine {name} failed:\n{proc.stderr[-4000:]}"
    result = json.loads(line.split(" ", 1)[1])
    result["log"] = proc.stdout + proc.stderr
    result["stats"] = json.loads(stats.read_text()) if stats is not None and stats.exists() else None
    return result


def corrupt_stored_page(store: Path, group: int, key: bytes, rank: int = 0, ranks: int = 1) -> None:
    """A foreign byte in the middle of a stored page's payload, in the slice of TP rank
    ``rank`` of ``ranks`` (a page holds every rank's slice, rank after rank)."""
    bad, at, length = stored_payload(store, group, key)
    raw = bytearray(bad.read_bytes())
    width = length // ranks
    raw[at + rank * width + width // 2] ^= 0xFF
    bad.write_bytes(bytes(raw))


def stored_payload(store: Path, group: int, key: bytes) -> tuple[Path, int, int]:
    """The file holding a stored page (its own file or a pack) in any namespace of the store,
    and where its payload lies in it: (path, offset, length)."""
    for layout_dir in sorted(p for p in store.iterdir() if p.is_dir()):
        own = layout_dir / f"g{group}" / key.hex()[:2] / f"{key.hex()}.blk"
        if own.exists():
            return own, pagefile.HEADER_BYTES, own.stat().st_size - pagefile.HEADER_BYTES
        for pack in (layout_dir / "packs").glob(f"*{packfile.SUFFIX}"):
            fd = os.open(pack, os.O_RDONLY)
            try:
                table = packfile.read_table(fd)
                for i in range(len(table)):
                    if (int(table["group"][i]), table["key"][i, : table["key_len"][i]].tobytes()) == (group, key):
                        return pack, int(table["offset"][i]), int(table["length"][i])
            finally:
                os.close(fd)
    raise FileNotFoundError(f"page {key.hex()} of group {group} is not in {store}")


def keys_of(prompt: list[int], block_tokens: int) -> list[bytes]:
    return block_hashes(prompt, block_tokens)


def vllm_objects(block=128, tp=1, state_block=None, model="m", commit="0" * 40):
    """vLLM's config (the fields hybridkv reads) and a real KVCacheConfig of a small hybrid
    model: group 0 a Mamba-style state, group 1 attention."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    attention = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.float32)
    state = MambaSpec(block_size=state_block or block, shapes=((3, 128),), dtypes=(torch.float32,),
                      page_size_padded=attention.page_size_bytes, mamba_cache_mode="align")
    kv = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l0", "l1"], state), KVCacheGroupSpec(["l2"], attention)])
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model=str(model), max_model_len=4096, revision=None, dtype=torch.float32,
                                     hf_config=SimpleNamespace(_commit_hash=commit)))
    return config, kv

