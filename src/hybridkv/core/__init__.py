"""Pure cache logic: layouts, keys, retention, the hit rule, pool planning. No I/O, no torch."""
