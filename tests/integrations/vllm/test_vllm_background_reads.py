"""Disk reads in the background (``kv_load_failure_policy: recompute``): two requests for the same
stored prompt in one batch, in a new process. The lookup starts the reads and returns; the
second request waits on the first one's reads instead of reading the pages again or missing,
and both decode as the same batch served by vLLM's own prefix cache."""

from engines import run_engine, tokens

P = tokens(41, 2048)


def test_one_batch_restores_a_prompt_twice_from_one_read_of_its_pages(checkpoints, tmp_path):
    model, store = checkpoints("lfm2"), tmp_path / "store"
    store.mkdir()
    connector = {"store": str(store), "ram_dir": str(tmp_path), "ram_bytes": "64MiB"}
    run_engine(model, "lfm2", connector, [{"tokens": P}], tmp_path, "cold")
    run = run_engine(model, "lfm2", connector, [{"batch": [P, P]}, {"batch": [P, P]}], tmp_path, "restart",
                     transfer={"kv_load_failure_policy": "recompute"})
    restored, local = run["requests"][0]["batch"], run["requests"][1]["batch"]
    assert [b["cached"] >= 1920 for b in restored] == [True, True], restored
    assert [b["cached"] for b in local] == [b["cached"] for b in restored]    # vLLM's own cache
    assert [b["tokens"] for b in restored] == [b["tokens"] for b in local]
    stats = run["stats"]
    assert stats["vllm"]["async_promotion"] and stats["vllm"]["loads"] == 2, stats["vllm"]
    assert stats["vllm"]["promotion_failures"] == 0 and stats["vllm"]["load_failures"] == 0
    first, second = stats["requests"][:2]
    assert first["sources"]["fs"] > 0 and first["loaded_tokens"] == second["loaded_tokens"]
    assert stats["cache"]["tiers"]["fs"]["hits"] == first["sources"]["fs"]     # each page read once
    assert all(g["evictable"] == g["used"] for g in stats["cache"]["groups"].values())   # no pin left
