"""Tiny random-weight checkpoints of each hybrid family vLLM's CPU build runs.

For trying the connector and for its tests without downloading weights: a few hundred
thousand parameters, seeded (every build is byte-identical), saved with ``save_pretrained``.
Qwen3-Next needs bfloat16 and 128-wide linear-attention heads on CPU (vLLM's CPU GDN kernel).
"""

from __future__ import annotations

import json
from pathlib import Path

COMMON = dict(vocab_size=512, hidden_size=128, max_position_embeddings=8192,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              initializer_range=0.05)

FAMILIES = {
    "llama": ("LlamaConfig", "float32", dict(
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, architectures=["LlamaForCausalLM"])),
    "lfm2": ("Lfm2Config", "float32", dict(
        intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3,
        block_auto_adjust_ff_dim=False, architectures=["Lfm2ForCausalLM"])),
    "qwen3_next": ("Qwen3NextConfig", "bfloat16", dict(
        intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=2, linear_num_value_heads=4, decoder_sparse_step=1,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[],
        architectures=["Qwen3NextForCausalLM"])),
    "granite_h": ("GraniteMoeHybridConfig", "float32", dict(
        intermediate_size=256, shared_intermediate_size=256, num_local_experts=0,
        num_experts_per_tok=0, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "mamba", "mamba", "attention"], mamba_n_heads=8, mamba_n_groups=1,
        mamba_d_state=64, mamba_d_head=32, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
        position_embedding_type="rope", architectures=["GraniteMoeHybridForCausalLM"])),
}


def dtype_of(family: str) -> str:
    return FAMILIES[family][1]


def save_tiny_checkpoint(family: str, directory: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of a seeded tiny model; returns the dir."""
    import torch
    import transformers

    config_class, dtype, kwargs = FAMILIES[family]
    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    config = getattr(transformers, config_class)(**COMMON, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    path = directory / "config.json"
    saved = json.loads(path.read_text())
    saved["torch_dtype"] = dtype
    if family == "lfm2":    # vLLM reads these fields of real LFM2 configs; transformers omits them
        saved["conv_dim"] = saved["conv_dim_out"] = saved["block_dim"] = saved["hidden_size"]
        saved["block_ff_dim"] = saved["intermediate_size"]
    path.write_text(json.dumps(saved, indent=1))
    return directory
