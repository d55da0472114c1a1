"""Run token-id prompts through an offline vLLM engine with hybridkv; print JSON results.

    python -m hybridkv.tools.vllm_run JOB.json

The job names the model directory, dtype, the connector's extra config (or null for plain
vLLM), optionally more ``KVTransferConfig`` fields (``"transfer"``) and a
``"tensor_parallel_size"`` (workers in processes of their own, each bound to a core of its
own unless ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise: vLLM's CPU build refuses ranks that
share cores), ``"kv_cache_dtype"`` (vLLM's, e.g. ``fp8_e5m2``), ``"max_lora_rank"`` (LoRA on),
and a list of requests run one after another. On a request:

- ``"reset": true`` empties vLLM's own prefix cache first, so a repeat must come from hybridkv;
  ``"reset_connector": true`` empties hybridkv's too, as after a weight update.
- ``"batch": [ids, ...]`` in place of ``"tokens"`` submits several prompts at once (one result
  list).
- ``"salt"`` is vLLM's ``cache_salt`` (a salted prompt shares no page with the unsalted one: a
  cold control).
- ``"lora": [name, id, path]`` runs the request under that adapter (with ``"max_lora_rank"``).
- ``"unlink_ram_regions": true`` removes the RAM region files from ``ram_dir`` first, so the
  worker cannot attach them (a failure test).

``"time_steps": true`` runs the engine core in this process and adds to each result the wall
time of every engine step it took (``"step_s"``): scheduling, the forward and the connector's
work in it, as the server's engine loop runs them.

One process = one engine: the tests and the vLLM benchmark start a fresh process to simulate a
restart.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def cpu_threads_bind(tp: int) -> str:
    """One core per rank for vLLM's CPU build (``VLLM_CPU_OMP_THREADS_BIND``), e.g. ``0|1``."""
    return "|".join(str(i % os.cpu_count()) for i in range(tp))


def _timed(step, into: list[float]):
    def timed_step():
        start = time.perf_counter()
        out = step()
        into.append(time.perf_counter() - start)
        return out
    return timed_step


def run(job: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    tp = job.get("tensor_parallel_size", 1)
    if job.get("time_steps"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # a step is then one call here
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_threads_bind(tp))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if job.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HybridKVConnector", kv_connector_module_path="hybridkv.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=job["connector"], **job.get("transfer", {}))
    if tp > 1:
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    if job.get("kv_cache_dtype"):
        kwargs["kv_cache_dtype"] = job["kv_cache_dtype"]
    if job.get("max_lora_rank"):         # requests may then name an adapter: "lora": [name, id, path]
        kwargs.update(enable_lora=True, max_lora_rank=job["max_lora_rank"], max_loras=1)
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), enforce_eager=True,
              skip_tokenizer_init=True, enable_prefix_caching=True,
              max_model_len=job.get("max_model_len", 4096),
              max_num_batched_tokens=job.get("max_num_batched_tokens", 2048),
              seed=0, **kwargs)
    results = {"engine_start_s": round(time.perf_counter() - t0, 2), "requests": []}
    steps: list[float] = []
    if job.get("time_steps"):
        llm.llm_engine.step = _timed(llm.llm_engine.step, steps)
    for req in job["requests"]:
        if req.get("unlink_ram_regions"):         # fault injection: the worker cannot attach them
            for region in Path(job["connector"]["ram_dir"]).iterdir():
                region.unlink()
        if req.get("reset") or req.get("reset_connector"):
            llm.reset_prefix_cache(reset_connector=bool(req.get("reset_connector")))
        params = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 8), ignore_eos=True)
        salted = {"cache_salt": req["salt"]} if req.get("salt") else {}
        prompts = [TokensPrompt(prompt_token_ids=ids, **salted) for ids in req.get("batch") or [req["tokens"]]]
        start = time.perf_counter()
        lora = None
        if req.get("lora"):
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(*req["lora"])
        outs = [{"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0}
                for out in llm.generate(prompts, params, use_tqdm=False, lora_request=lora)]
        seconds = round(time.perf_counter() - start, 4)
        result = {"batch": outs, "seconds": seconds} if "batch" in req else {**outs[0], "seconds": seconds}
        if job.get("time_steps"):
            result["step_s"] = [round(s, 6) for s in steps]
            steps.clear()
        results["requests"].append(result)
    del llm
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hybridkv.tools.vllm_run JOB.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    print("HYBRIDKV_RESULT " + json.dumps(run(job)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
