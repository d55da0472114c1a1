"""A worker that cannot copy: the failure reaches vLLM as failed blocks, never as an exception,
and under ``kv_load_failure_policy=recompute`` the request is recomputed with the cold tokens."""

from engines import run_engine, tokens

P = tokens(1, 2048)


def test_a_worker_that_cannot_attach_ram_fails_the_load_and_vllm_recomputes(checkpoints, tmp_path):
    model, store, ram = checkpoints("lfm2"), tmp_path / "store", tmp_path / "ram"
    store.mkdir()
    ram.mkdir()
    connector = {"store": str(store), "ram_dir": str(ram), "ram_bytes": "64MiB"}
    cold = run_engine(model, "lfm2", connector, [{"tokens": P}], tmp_path, "A")
    assert cold["stats"]["vllm"]["store_failures"] == 0
    # a new engine finds P on disk and promotes it into RAM, whose files are gone before the
    # worker first attaches them: the load and every store fail inside the worker
    broken = run_engine(model, "lfm2", connector, [{"tokens": P, "unlink_ram_regions": True}],
                        tmp_path, "B", transfer={"kv_load_failure_policy": "recompute"})
    stats = broken["stats"]["vllm"]
    assert stats["loads"] == 1 and stats["load_failures"] == 1, stats
    assert stats["store_failures"] >= 1, stats
    assert broken["requests"][0]["tokens"] == cold["requests"][0]["tokens"]
