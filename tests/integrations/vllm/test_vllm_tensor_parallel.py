"""Stock vLLM at tensor_parallel_size=2 with HybridKVConnector, in real engine processes (one
core per worker rank). Each rank copies its own slice of every page; a page is all ranks'
slices. Every restore is compared with a cold run of the same tokens in the same engine kind.

Qwen3-Next (GDN states + attention): a TP=1 engine stores P first; engine A (TP=2) on the same
store must miss it, serves P, a sibling that stores a junction, a third prompt hitting it, and
R; one byte of rank 1's slice of R's stored state is flipped; engine B (TP=2, a new process)
restores P from disk and misses R's damaged state; a TP=1 engine then misses what only TP=2
stored and still hits its own pages. LFM2 and Granite-4.0-H: a junction and a new-process disk
restore. Llama: two TP=2 engines with their own disks and RAM share one redis-server; the
second restores what the first stored.
"""

import pytest

from engines import corrupt_stored_page, keys_of, run_engine, tokens

P, R = tokens(31, 2048), tokens(32, 2048)
SIBLING, THIRD = P[:1100] + tokens(33, 948), P[:1100] + tokens(34, 948)
STATE_GROUP = 0


def replay(n: int, B: int) -> int:
    return (n - 1) // B * B


@pytest.fixture(scope="module")
def qwen(checkpoints, tmp_path_factory):
    work = tmp_path_factory.mktemp("tp-qwen3-next")
    model, store = checkpoints("qwen3_next"), work / "store"
    store.mkdir()
    connector = {"store": str(store), "ram_bytes": "64MiB"}
    tp1_first = run_engine(model, "qwen3_next", connector, [{"tokens": P}], work, "tp1-first")
    a = run_engine(model, "qwen3_next", connector, [
        {"tokens": P}, {"tokens": P, "reset": True},
        {"tokens": SIBLING, "reset": True}, {"tokens": THIRD, "reset": True},
        {"tokens": THIRD, "reset": True, "salt": "cold"}, {"tokens": R, "reset": True},
    ], work, "A", tp=2)
    B = a["stats"]["block_tokens"]
    corrupt_stored_page(store, STATE_GROUP, keys_of(R, B)[replay(len(R), B) // B - 1], rank=1, ranks=2)
    b = run_engine(model, "qwen3_next", connector, [{"tokens": P}, {"tokens": R, "reset": True}],
                   work, "B", tp=2)
    tp1_again = run_engine(model, "qwen3_next", connector, [
        {"tokens": R}, {"tokens": R, "reset": True, "salt": "cold"}, {"tokens": P, "reset": True},
    ], work, "tp1-again")
    return {"tp1_first": tp1_first, "A": a, "B": b, "tp1_again": tp1_again, "B_tokens": B}


def test_a_tp1_store_is_a_miss_at_tp2_with_tokens_identical_to_cold(qwen):
    a = qwen["A"]["requests"]
    assert a[0]["cached"] == 0                  # P's TP=1 pages are in the store, in another namespace
    assert a[1]["tokens"] == a[0]["tokens"] and a[1]["cached"] >= replay(len(P), qwen["B_tokens"])


def test_a_sibling_stores_a_junction_at_tp2_and_a_third_request_hits_it(qwen):
    a, B = qwen["A"]["requests"], qwen["B_tokens"]
    assert a[3]["cached"] >= 1100 // B * B      # the junction state the sibling stored
    assert a[3]["tokens"] == a[4]["tokens"]     # identical to THIRD computed cold (salted)
    assert qwen["A"]["stats"]["vllm"]["store_failures"] == 0


def test_a_new_tp2_process_restores_from_disk_and_misses_a_damaged_slice(qwen):
    a, b, B = qwen["A"]["requests"], qwen["B"]["requests"], qwen["B_tokens"]
    assert b[0]["cached"] >= replay(len(P), B) - B and b[0]["tokens"] == a[0]["tokens"]
    # R's replay state has a flipped byte in rank 1's slice: that page misses, the output is cold
    assert b[1]["cached"] < replay(len(R), B) and b[1]["tokens"] == a[5]["tokens"]
    assert qwen["B"]["stats"]["cache"]["tiers"]["fs"].get("corrupt", 0) >= 1


def test_a_tp2_store_is_a_miss_at_tp1_which_still_hits_its_own_pages(qwen):
    again, first = qwen["tp1_again"]["requests"], qwen["tp1_first"]["requests"]
    assert again[0]["cached"] == 0 and again[0]["tokens"] == again[1]["tokens"]
    assert again[2]["cached"] >= replay(len(P), qwen["B_tokens"]) - qwen["B_tokens"]
    assert again[2]["tokens"] == first[0]["tokens"]


@pytest.mark.parametrize("family", ["lfm2", "granite_h"])
def test_a_new_tp2_process_restores_from_disk_and_a_third_request_hits_the_junction(checkpoints, tmp_path, family):
    """Short conv (LFM2) and Mamba2 (Granite-4.0-H) states sharded over two ranks."""
    model, store = checkpoints(family), tmp_path / "store"
    store.mkdir()
    connector = {"store": str(store), "ram_bytes": "64MiB"}
    a = run_engine(model, family, connector, [
        {"tokens": P}, {"tokens": SIBLING, "reset": True}, {"tokens": THIRD, "reset": True},
        {"tokens": THIRD, "reset": True, "salt": "cold"}], tmp_path, "A", tp=2)
    b = run_engine(model, family, connector, [{"tokens": P}], tmp_path, "B", tp=2)
    B, runs = a["stats"]["block_tokens"], a["requests"]
    assert runs[2]["cached"] >= 1100 // B * B and runs[2]["tokens"] == runs[3]["tokens"]
    restored = b["requests"][0]
    assert restored["cached"] >= replay(len(P), B) - B and restored["tokens"] == runs[0]["tokens"]


def test_two_tp2_servers_share_one_redis(checkpoints, tmp_path, redis_server):
    model = checkpoints("llama")
    remote = {"remote": redis_server.url, "remote_prefix": "tp2-llama", "ram_bytes": "64MiB"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = run_engine(model, "llama", {"store": str(tmp_path / "a"), **remote}, [{"tokens": P}], tmp_path, "A", tp=2)
    second = run_engine(model, "llama", {"store": str(tmp_path / "b"), **remote}, [{"tokens": P}], tmp_path, "B", tp=2)
    served = second["stats"]["cache"]["tiers"]["remote"]["hits"]
    assert second["requests"][0]["cached"] >= replay(len(P), second["stats"]["block_tokens"]) and served > 0
    assert second["requests"][0]["tokens"] == first["requests"][0]["tokens"]
