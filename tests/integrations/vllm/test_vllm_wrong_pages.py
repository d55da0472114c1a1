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


def _adapter(directory, model, seed: int):
    """A PEFT LoRA adapter for the tiny model's attention projections, with seeded weights
    large enough to change what the model computes."""
    import json

    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    outs = {"q_proj": hidden, "k_proj": kv * hidden // heads, "v_proj": kv * hidden // heads}
    gen, rank, tensors = torch.Generator().manual_seed(seed), 8, {}
    for layer, kind in enumerate(config["layer_types"]):
        if kind != "full_attention":
            continue
        for name, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(outs), "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model)}))
    return directory


def test_two_adapters_under_one_name_and_id_do_not_share_pages(checkpoints, tmp_path):
    """Two servers that call different adapter weights by the same name and id (a redeploy, two
    teams): the second must not be served the first's pages."""
    model, store = checkpoints(FAMILY), tmp_path / "store"
    store.mkdir()
    first, second = _adapter(tmp_path / "a", model, 1), _adapter(tmp_path / "b", model, 2)
    connector = {"store": str(store), "ram_bytes": "64MiB"}
    stored = run_engine(model, FAMILY, connector, [{"tokens": PROMPT, "lora": ["tuned", 1, str(first)]},
                                                   {"tokens": PROMPT, "lora": ["tuned", 1, str(first)], "reset": True}],
                        tmp_path, "adapter-a", max_lora_rank=8)
    assert stored["requests"][1]["cached"] > 0                   # the same adapter hits
    other = run_engine(model, FAMILY, connector, [{"tokens": PROMPT, "lora": ["tuned", 1, str(second)]}],
                       tmp_path, "adapter-b", max_lora_rank=8)
    cold = run_engine(model, FAMILY, None, [{"tokens": PROMPT, "lora": ["tuned", 1, str(second)]}],
                      tmp_path, "adapter-b-cold", max_lora_rank=8)
    assert other["requests"][0]["cached"] == 0
    assert sum(other["stats"]["requests"][0]["sources"].values()) == 0
    assert other["requests"][0]["tokens"] == cold["requests"][0]["tokens"]
