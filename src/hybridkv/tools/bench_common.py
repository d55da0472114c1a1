"""What every benchmark shares: the median of repeats, GB/s, a one-group layout of a page
size, and the machine and versions a result was measured on."""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable

import numpy as np

from hybridkv.core.layout import layout_from_dict

GB = 1e9
MiB = 1024 * 1024


def median(fn: Callable[[], float], repeats: int) -> tuple[float, list[float]]:
    values = [fn() for _ in range(repeats)]
    return statistics.median(values), [min(values), max(values)]

def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB

def page_layout(page_bytes: int):
    return layout_from_dict({"model": "bench", "block_tokens": 64, "max_model_len": 1 << 20,
                             "groups": [{"id": 0, "kind": "attention", "page_bytes": page_bytes}]})

def machine() -> dict:
    import platform

    try:
        import torch
    except ImportError:               # the cache and the simulator run without it
        torch = None
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__ if torch else None, "numpy": np.__version__}
