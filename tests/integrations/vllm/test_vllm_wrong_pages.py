"""A page stored under one KV format is never served to an engine of another: an fp8_e4m3
engine's pages are a miss for an fp8_e5m2 engine on the same store, whose tokens are then its
own cold run's (the same bytes read as the other format would be wrong tokens, not an error)."""

from engines import run_engine, tokens

FAMILY = "lfm2"
PROMPT = tokens(41, 1536)


def test_fp8_e4m3_pages_are_a_miss_for_an_fp8_e5m2_engine(checkpoints, tmp_path):
    model, store = checkpoints(FAMILY), tmp_path / "store"
    store.mkdir()
    connector = {"store": str(store), "ram_bytes": "64MiB"}
    stored = run_engine(model, FAMILY, connector, [{"tokens": PROMPT}, {"tokens": PROMPT, "reset": True}],
                        tmp_path, "e4m3", kv_cache_dtype="fp8_e4m3")
    assert stored["stats"]["requests"][0]["stored"]["attention"] > 0
    assert stored["requests"][1]["cached"] > 0                   # the same format hits
    other = run_engine(model, FAMILY, connector, [{"tokens": PROMPT}], tmp_path, "e5m2",
                       kv_cache_dtype="fp8_e5m2")
    cold = run_engine(model, FAMILY, None, [{"tokens": PROMPT}], tmp_path, "e5m2-cold",
                      kv_cache_dtype="fp8_e5m2")
    assert other["requests"][0]["cached"] == 0
    assert sum(other["stats"]["requests"][0]["sources"].values()) == 0
    assert other["requests"][0]["tokens"] == cold["requests"][0]["tokens"]
    assert len([d for d in store.iterdir() if d.is_dir()]) == 2  # one namespace per format
