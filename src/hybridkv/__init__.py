"""hybridkv: a tiered prefix cache for the KV blocks and recurrent states of hybrid LLMs."""

from hybridkv.config import CacheConfig, load_config
from hybridkv.errors import HybridKVError
from hybridkv.layout import Group, Layout, layout_from_dict, load_layout

__all__ = ["CacheConfig", "Group", "HybridKVError", "Layout", "layout_from_dict", "load_config",
           "load_layout"]
__version__ = "0.1.0"
