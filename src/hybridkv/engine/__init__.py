"""The reference engine: Hugging Face transformers hybrid models with the cache attached."""

import os

# A restore builds its cache tensors at once (megabytes each); in 4 KiB pages a fresh process
# faults on every one of them, which doubled a first restore from disk. torch backs large
# allocations with transparent huge pages when asked, and reads this once, at its first one.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from hybridkv.engine.engine import Engine, GenerationResult

__all__ = ["Engine", "GenerationResult"]
