"""Built-in tiny hybrid models (seeded random weights) and loading of local checkpoints.

The built-ins let everything run offline: each is a small config of a real hybrid family,
built with ``torch.manual_seed(0)``, so two processes get the same weights and outputs.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridkv.core.errors import HybridKVError

log = logging.getLogger(__name__)

VOCAB = 512
MAX_LEN = 32768
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=MAX_LEN, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64)
GDN = dict(head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
           linear_value_head_dim=32, linear_conv_kernel_dim=4)
LINEAR3_FULL1 = ["linear_attention"] * 3 + ["full_attention"]
# Families whose transformers code computes chunked prefill on a non-empty cache wrongly.
REFUSED = {"jamba": "Jamba's transformers code drops the SSM state in multi-token forwards on a cache",
           "minimax": "MiniMax's cached lightning-attention path disagrees with its uncached path"}


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    family: str
    config_class: str
    model_class: str
    kwargs: dict


BUILTINS = {m.name: m for m in [
    BuiltinModel("tiny-hybrid", "qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
                 {**COMMON, **GDN, "num_hidden_layers": 4, "layer_types": LINEAR3_FULL1,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 128}),
    BuiltinModel("tiny-qwen3.5", "qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                 {**COMMON, **GDN, "num_hidden_layers": 4, "layer_types": LINEAR3_FULL1}),
    BuiltinModel("tiny-bamba", "bamba", "BambaConfig", "BambaForCausalLM",
                 {**COMMON, **MAMBA2, "num_hidden_layers": 4, "attn_layer_indices": [3]}),
    BuiltinModel("tiny-granite-hybrid", "granitemoehybrid", "GraniteMoeHybridConfig",
                 "GraniteMoeHybridForCausalLM",
                 {**COMMON, **MAMBA2, "num_hidden_layers": 4, "layer_types": ["mamba"] * 3 + ["attention"],
                  "num_local_experts": 0, "shared_intermediate_size": 256}),
    BuiltinModel("tiny-falcon-h1", "falcon_h1", "FalconH1Config", "FalconH1ForCausalLM",
                 {**COMMON, **MAMBA2, "num_hidden_layers": 2, "mamba_d_ssm": 256}),
    BuiltinModel("tiny-zamba2", "zamba2", "Zamba2Config", "Zamba2ForCausalLM",
                 {**{k: v for k, v in COMMON.items() if k != "intermediate_size"},
                  "num_hidden_layers": 4, "layers_block_type": ["mamba", "mamba", "mamba", "hybrid"],
                  "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "n_mamba_heads": 8,
                  "mamba_ngroups": 1, "chunk_size": 64, "intermediate_size": 256,
                  "attention_head_dim": 32, "use_mamba_kernels": False}),
    BuiltinModel("tiny-nemotron-h", "nemotron_h", "NemotronHConfig", "NemotronHForCausalLM",
                 {**COMMON, "num_hidden_layers": 4, "layers_block_type": ["mamba", "mlp", "mamba", "attention"],
                  "head_dim": 32, "ssm_state_size": 16, "mamba_num_heads": 8, "mamba_head_dim": 32,
                  "n_groups": 1, "conv_kernel": 4, "expand": 2, "chunk_size": 64,
                  "use_mamba_kernels": False}),
    BuiltinModel("tiny-lfm2", "lfm2", "Lfm2Config", "Lfm2ForCausalLM",
                 {**{k: v for k, v in COMMON.items() if k != "intermediate_size"},
                  "intermediate_size": 256, "num_hidden_layers": 4,
                  "layer_types": ["conv", "conv", "conv", "full_attention"], "conv_L_cache": 3}),
]}


def build_builtin(name: str, dtype: torch.dtype = torch.float32):
    """Construct a built-in model with seeded random weights (same weights in every process)."""
    import transformers

    spec = BUILTINS[name]
    config = getattr(transformers, spec.config_class)(**spec.kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, spec.model_class)(config).to(dtype).eval()
    return model


def weights_digest(model) -> str:
    """Identity of in-memory weights (the built-ins', which are generated, not stored)."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode() + b"\0" + str(tensor.dtype).encode())
        h.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return "sha256:" + h.hexdigest()[:32]


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32):
    """A built-in name, or a local checkpoint directory (returns model, tokenizer or None)."""
    if name_or_path in BUILTINS:
        return build_builtin(name_or_path, dtype), None
    path = Path(name_or_path)
    if not path.is_dir():
        raise HybridKVError(
            f"unknown model {name_or_path!r}: not a built-in ({', '.join(BUILTINS)}) and not a local "
            "checkpoint directory; see 'hybridkv models'"
        )
    try:
        import transformers

        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad directory
        raise HybridKVError(f"cannot load model config from {path}: {e}") from None
    model_type = getattr(config, "model_type", "")
    if model_type in REFUSED:
        raise HybridKVError(f"{model_type} is not supported: {REFUSED[model_type]}; "
                            "cached states would be wrong")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=dtype).eval()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        log.warning("no tokenizer in %s; text prompts use the byte tokenizer (ids = bytes + 3)", path)
        tokenizer = None
    return model, tokenizer


class ByteTokenizer:
    """The built-ins' tokenizer: UTF-8 bytes shifted past the special ids (0 pad, 1 bos, 2 eos)."""

    offset = 3

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(i - self.offset for i in ids if self.offset <= i < 256 + self.offset).decode(
            "utf-8", errors="replace")


ATTENTION_TYPES = {"full_attention", "attention", "hybrid"}
STATE_TYPES = {"linear_attention", "mamba", "conv", "hybrid"}


def describe_builtins() -> list[dict]:
    """Name, family and layer counts of each built-in, from its config (no weights built)."""
    import transformers

    out = []
    for spec in BUILTINS.values():
        config = getattr(transformers, spec.config_class)(**spec.kwargs)
        types = list(getattr(config, "layer_types", None) or [])
        out.append({"name": spec.name, "family": spec.family,
                    "attention_layers": sum(t in ATTENTION_TYPES for t in types),
                    "state_layers": sum(t in STATE_TYPES for t in types)})
    return out
