"""The reference engine: Hugging Face transformers hybrid models with the cache attached."""

from hybridkv.engine.engine import Engine, GenerationResult

__all__ = ["Engine", "GenerationResult"]
