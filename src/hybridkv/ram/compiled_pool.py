"""The slot pool compiled: ``ram/_slotpool.c`` behind ``SlotPool``'s interface.

Same operations, same victims and slot order as ``SlotPool`` with the LRU/ARC policies
(tests/ram/test_compiled_pool.py drives both with the same random operations), but a key
lives in one C hash table and one entry instead of four to six dicts. Importing this module
raises ImportError when the extension was not built; ``pool.make_pool`` then uses Python.
"""

from __future__ import annotations

from hybridkv.ram import _slotpool
from hybridkv.ram.pool import Lookup, PoolReports, StorePlan

_slotpool.bind(Lookup.MISS, Lookup.HIT, Lookup.HIT_PENDING, StorePlan)


class CompiledSlotPool(_slotpool.SlotTable, PoolReports):
    """``CompiledSlotPool(group_id, capacity, policy="lru"|"arc")``."""

    __slots__ = ()
