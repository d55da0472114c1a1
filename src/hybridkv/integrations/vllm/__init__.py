"""hybridkv inside stock vLLM: ``kv_connector_module_path="hybridkv.integrations.vllm"``."""

from hybridkv.integrations.vllm.connector import HybridKVConnector

__all__ = ["HybridKVConnector"]
