"""``vllm serve --tensor-parallel-size 2`` with the connector, queried with the openai client,
restarted, queried again: the restart restores the prompt from disk (the second server reads
it in the background, as the README runs it; each rank loads its slice of every page) and the
completion is identical."""

import json
import re
import urllib.request

import pytest

from hybridkv.tiers.admin import inspect_store
from hybridkv.tools.bench_vllm_load import ServeProcess

from engines import engine_env, tokens

FAMILY = "lfm2"
PROMPT = tokens(21, 2048)
TP = 2
START_TIMEOUT_S = 400


class Server(ServeProcess):
    def __init__(self, model, store, log_path, stats_path, **transfer):
        config = {"kv_connector": "HybridKVConnector", "kv_role": "kv_both",
                  "kv_connector_module_path": "hybridkv.integrations.vllm",
                  "kv_connector_extra_config": {"store": str(store), "ram_bytes": "64MiB",
                                                "stats_file": str(stats_path)}, **transfer}
        super().__init__(
            ["--model", str(model), "--served-model-name", "tiny",
             "--enforce-eager", "--skip-tokenizer-init", "--enable-prefix-caching",
             "--max-model-len", "4096", "--enable-prompt-tokens-details",
             "--tensor-parallel-size", str(TP), "--distributed-executor-backend", "mp",
             # vLLM kills the engine at once on a stop by default (0 s); waiting lets the
             # connector drain the writes still in flight (docs/vllm.md)
             "--shutdown-timeout", "30",
             "--kv-transfer-config", json.dumps(config)],
            log_path, engine_env(tp=TP), START_TIMEOUT_S)

    def complete(self, prompt):
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none")
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        details = out.usage.prompt_tokens_details
        return out.choices[0].token_ids, (details.cached_tokens if details else 0) or 0

    def cached_by_source(self) -> dict[str, float]:
        """vLLM's prompt_tokens_cached_by_source counter, by source, from /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
            text = response.read().decode()
        found = re.findall(r'^vllm:prompt_tokens_cached_by_source_total\{.*source="(\w+)".*\} (\S+)$', text, re.M)
        return {source: float(value) for source, value in found}


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    model, store = checkpoints(FAMILY), work / "store"
    store.mkdir()
    first = Server(model, store, work / "serve-1.log", work / "stats-1.json")
    try:
        cold = first.complete(PROMPT)
    finally:
        first.stop()            # at once: the last pages may still be on their way to disk
    (stored,) = inspect_store(store)["namespaces"]
    # as the README runs it: disk reads in the background, a failed one recomputed
    second = Server(model, store, work / "serve-2.log", work / "stats-2.json", kv_load_failure_policy="recompute")
    try:
        warm = second.complete(PROMPT)
        by_source = second.cached_by_source()
    finally:
        second.stop()
    return cold, warm, stored, by_source, work


def test_restart_restores_from_disk_with_identical_completion(served):
    (cold_tokens, cold_cached), (warm_tokens, warm_cached), stored, by_source, work = served
    assert cold_cached == 0
    said = [line for n in (1, 2) for line in (work / f"serve-{n}.log").read_text().splitlines()
            if "hybridkv" in line and "non-default args" not in line]
    # what each server's connector did per request and per tier, should the restore miss
    stats = [json.loads((work / f"stats-{n}.json").read_text()) for n in (1, 2)]
    said += [{k: s[k] for k in ("requests", "vllm", "cache")} for s in stats]
    # the stop waited for the writes: all 16 prompt blocks and the 3 conv states are on disk
    assert stored["packs"]["pages"] == 16 + 3, (stored, said)
    assert warm_cached >= 1024, said      # lfm2's block is 128 tokens: replay boundary 1920
    assert warm_tokens == cold_tokens and len(cold_tokens) == 8
    assert stats[1]["vllm"]["async_promotion"] and stats[1]["vllm"]["promotion_failures"] == 0, said
    # vLLM's metrics name the tier: every restored token came from disk
    assert by_source.get("disk") == warm_cached and by_source.get("external_unspecified", 0) == 0, by_source
