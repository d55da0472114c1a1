"""CUDA host registration of RAM regions, so device copies from them are DMA (DESIGN §8).

Lives with the engine because it needs torch; the cache receives it as a ``pin_hook``.
"""

from __future__ import annotations

import torch

from hybridkv.ram.regions import PinHook, SharedRegion


def cuda_pin_hook(region: SharedRegion) -> None:
    """Register the mapping with CUDA; a non-zero result is fatal (the caller names the region)."""
    tensor = torch.from_numpy(region.array)
    result = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), region.nbytes, 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister returned {int(result)}")


def default_pin_hook() -> PinHook | None:
    """Pin on GPU machines, nothing elsewhere."""
    return cuda_pin_hook if torch.cuda.is_available() else None
