"""hybridkv: a tiered prefix cache for the KV blocks and recurrent states of hybrid LLMs.

Integrators build a ``Layout`` (or load one), a ``CacheConfig``, then a ``TieredCache`` and a
``Connector`` over it; ``plan_pools`` says how a RAM budget splits between groups.
"""

from hybridkv.cache import TieredCache
from hybridkv.config import CacheConfig, load_config, load_layout
from hybridkv.connector import Connector, RequestState
from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import Group, GroupKind, Layout, layout_from_dict
from hybridkv.core.planner import Plan, plan_pools
from hybridkv.core.retention import Hit, Retention

__all__ = ["CacheConfig", "Connector", "Group", "GroupKind", "Hit", "HybridKVError", "Layout", "Plan",
           "RequestState", "Retention", "TieredCache", "layout_from_dict", "load_config",
           "load_layout", "plan_pools"]
__version__ = "0.2.0"
