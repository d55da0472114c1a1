"""Faults inside vLLM's process never reach vLLM. A worker that cannot copy: its RAM region
files are removed under a running engine, so every load and store fails inside the worker. The
failure reaches vLLM per request, never as an exception; vLLM's ``kv_load_failure_policy``
decides the rest, and the engine serves on. A stats file that cannot be written costs one log
line."""

import pytest

from engines import run_engine, tokens

P, NEW = tokens(1, 2048), tokens(31, 2048)


@pytest.fixture(scope="module")
def stored(checkpoints, tmp_path_factory):
    """P cold and NEW cold in one engine; P's pages go to disk (NEW's to another store)."""
    work = tmp_path_factory.mktemp("failures")
    model, store, ram = checkpoints("lfm2"), work / "store", work / "ram"
    store.mkdir()
    ram.mkdir()
    connector = {"store": str(store), "ram_dir": str(ram), "ram_bytes": "64MiB"}
    cold = run_engine(model, "lfm2", connector, [{"tokens": P}], work, "A")
    cold_new = run_engine(model, "lfm2", None, [{"tokens": NEW}], work, "plain")
    return model, connector, work, cold["requests"][0]["tokens"], cold_new["requests"][0]["tokens"]


def broken_engine(stored, name: str, transfer: dict) -> dict:
    """A new engine that finds P on disk, then loses its RAM regions before the worker's
    first copy; NEW follows (a miss: computed, its stores fail)."""
    model, connector, work, _, _ = stored
    return run_engine(model, "lfm2", connector, [{"tokens": P, "unlink_ram_regions": True}, {"tokens": NEW}],
                      work, name, transfer=transfer)


def test_under_the_recompute_policy_vllm_recomputes_the_failed_load(stored):
    run = broken_engine(stored, "recompute", {"kv_load_failure_policy": "recompute"})
    stats = run["stats"]["vllm"]
    assert stats["loads"] == 1 and stats["load_failures"] == 1, stats
    assert stats["store_failures"] >= 1, stats
    assert [r["tokens"] for r in run["requests"]] == [stored[3], stored[4]]


def test_under_vllms_default_policy_the_request_fails_and_the_engine_serves_on(stored):
    run = broken_engine(stored, "fail", {})
    assert run["stats"]["vllm"]["load_failures"] == 1
    assert run["requests"][0]["tokens"] == []           # ended with an error, no tokens
    assert run["requests"][1]["tokens"] == stored[4]


def test_a_stats_file_that_cannot_be_written_costs_one_log_line(stored):
    model, connector, work, cold_p, _ = stored
    unwritable = {**connector, "stats_file": str(work / "no-such-dir" / "stats.json")}
    run = run_engine(model, "lfm2", unwritable, [{"tokens": P}, {"tokens": P, "reset": True}], work, "nostats")
    assert [r["tokens"] for r in run["requests"]] == [cold_p, cold_p]
    assert run["requests"][0]["cached"] > 0           # restored from disk all the same
    assert run["log"].count("cannot write stats_file") == 1

