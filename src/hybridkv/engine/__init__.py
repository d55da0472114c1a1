"""The reference engine: Hugging Face transformers hybrid models with the cache attached."""
