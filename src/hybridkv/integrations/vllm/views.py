"""vLLM's registered KV / state tensors as block views for the page copier.

vLLM registers one tensor per layer (``register_kv_caches``):
- attention: a 4-D ``[B, H, N, C]`` view in the physical order the engine resolved once
  (``kv_cache_layout``: LBNHC is CUDA's default, LBHNC the CPU build's, block-outer BL** when
  asked); when a backend splits each block into ``r`` kernel blocks, dim 0 counts kernel
  blocks and a block is ``r`` of them in a row;
- Mamba, GDN, short conv: an int8 ``[B, 1, 1, real page]`` view whose block stride is the
  padded page (the padding is never copied).
Groups alias the same memory; a view only ever reaches the blocks of its own group.

Each view is turned into one whose dim 0 is the scheduler's block and whose other dims are in
logical order (a split block folded back to ``[H, N, C]``), so a page's bytes are the same for
every physical layout and kernel split: changing either keeps the store. Layouts are taken from
vLLM, never guessed, and one this module does not know is refused at start-up.
"""

from __future__ import annotations

import torch

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import Layout
from hybridkv.device.page_copy import block_bytes, fold_kernel_blocks

KNOWN_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


def resolved_layout(vllm_config, kv_cache_config) -> str:
    """The physical layout vLLM chose for this engine (a name from ``KNOWN_LAYOUTS``), for the
    log and to refuse one whose views this module was not written for."""
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        name = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if name is None:
        return "unpublished"    # the views' strides still say everything the copier needs
    name = getattr(name, "name", name)
    name = ALIASES.get(name, name)
    if name not in KNOWN_LAYOUTS:
        raise HybridKVError(f"vLLM's KV cache layout {name!r} is not one hybridkv knows "
                            f"({', '.join(KNOWN_LAYOUTS)}); set VLLM_KV_CACHE_LAYOUT to one of them")
    return name


def block_view(tensor, num_blocks: int, layer: str) -> torch.Tensor:
    """The layer's tensor with the scheduler's block as dim 0 and a split block folded back."""
    if isinstance(tensor, (list, tuple)) or not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
        raise HybridKVError(f"vLLM registered {type(tensor).__name__} for layer {layer}, not a per-layer "
                            "[B, H, N, C] view; this vLLM version's cache format is not supported")
    try:
        return fold_kernel_blocks(tensor, num_blocks)
    except HybridKVError as e:
        raise HybridKVError(f"vLLM's tensor of layer {layer}: {e}") from None


def block_views(layout: Layout, kv_caches: dict, num_blocks: int) -> dict[int, list[torch.Tensor]]:
    """Per cacheable group, its layers' block views in the group's order."""
    views = {}
    for group in layout.cacheable_groups:
        missing = [name for name in group.layers if name not in kv_caches]
        if missing:
            raise HybridKVError(f"vLLM registered no KV tensor for layer {missing[0]} of group {group.id}")
        views[group.id] = [block_view(kv_caches[name], num_blocks, name) for name in group.layers]
    return views


def check_views(layout: Layout, views: dict[int, list[torch.Tensor]]) -> None:
    """The real tensors must hold what the scheduler's layout says, per rank: the shapes and
    dtypes its signature names, and the page bytes it budgets."""
    for gid, group_views in views.items():
        group = layout.group(gid)
        rank_page = group.page_bytes // layout.tp_size
        actual = block_bytes(group_views)
        if actual != rank_page:
            raise HybridKVError(
                f"vLLM's tensors of group {gid} hold {actual} B per block on this rank but the "
                f"scheduler's layout says {rank_page} B ({group.page_bytes} B over {layout.tp_size} "
                "ranks); this model's cache layout is not supported")
        kv = group.tensors[0] if group.tensors and group.tensors[0].name.startswith("kv") else None
        for v in group_views if kv is not None else ():
            if _logical_shape(v) != tuple(kv.shape) or str(v.dtype) != kv.dtype:
                raise HybridKVError(
                    f"vLLM's attention tensors of group {gid} are {_logical_shape(v)} {v.dtype} per block "
                    f"but the scheduler's layout says {tuple(kv.shape)} {kv.dtype}")


def _logical_shape(view: torch.Tensor) -> tuple[int, ...]:
    """[H, N, C] of a block view, a folded kernel split counted as N."""
    if view.dim() == 5:
        return (view.shape[1], view.shape[2] * view.shape[3], view.shape[4])
    return tuple(view.shape[1:])
