"""Adapters that plug hybridkv into serving engines (optional extras)."""
