"""CUDA host registration of RAM regions, so device copies from and to them are DMA.

Every process that copies between a GPU and a region registers its own mapping: the
scheduler's cache and each tensor-parallel worker. Registering one large shared mapping from
several processes at once can fail transiently (``pin_user_pages`` returns ENOMEM when page
migration races), so registration runs under the region's lock (``SharedRegion.run_pin_hook``)
and is retried with backoff; a final failure is fatal, never a silent fall back to pageable
copies at a fraction of the speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hybridkv.ram.regions import PinHook, SharedRegion

Register = Callable[[int, int], int]       # (address, bytes) -> CUDA error code, 0 = success


def _cuda_register(address: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))


def _cuda_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def cuda_pin_hook(register: Register = _cuda_register, unregister: Callable[[int], None] = _cuda_unregister,
                  attempts: int = 4, backoff_s: float = 0.05) -> PinHook:
    """A pin hook that registers a region's mapping (``attempts`` tries, doubling waits) and
    returns what undoes it; the region calls that before it unmaps."""
    def pin(region: SharedRegion) -> Callable[[], None]:
        address = torch.from_numpy(region.array).data_ptr()
        codes = []
        for attempt in range(attempts):
            code = register(address, region.nbytes)
            if code == 0:
                return lambda: unregister(address)
            codes.append(code)
            if attempt + 1 < attempts:
                time.sleep(backoff_s * 2 ** attempt)
        raise RuntimeError(f"cudaHostRegister failed {attempts} times (error codes {codes}); "
                           "raise the locked-memory limit (ulimit -l) or lower ram_bytes")
    return pin


def default_pin_hook() -> PinHook | None:
    """Pin on GPU machines, nothing elsewhere."""
    return cuda_pin_hook() if torch.cuda.is_available() else None
