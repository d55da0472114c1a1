"""Byte sizes as people write them: ``4GiB``, ``512MB``, ``1.5 GiB`` or a plain integer."""

import re

from hybridkv.core.errors import HybridKVError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int, field: str = "size") -> int:
    """Return a non-negative byte count; raise HybridKVError naming ``field`` otherwise."""
    if isinstance(value, bool):
        raise HybridKVError(f"{field}: expected a size like 4GiB, got {value!r}")
    if isinstance(value, int):
        number, unit = value, ""
    else:
        match = _SIZE.match(str(value))
        if not match:
            raise HybridKVError(
                f"{field}: cannot read {value!r} as a size; write e.g. 4GiB, 512MB or 1048576"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise HybridKVError(
            f"{field}: unknown unit {unit!r} in {value!r}; use B, KB, MB, GB, KiB, MiB, GiB or TiB"
        )
    if number < 0:
        raise HybridKVError(f"{field}: {value!r} is negative; sizes must be >= 0")
    return int(number * _UNITS[unit])


def format_size(n: int) -> str:
    """Human-readable binary size, e.g. ``4.00 GiB``."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
