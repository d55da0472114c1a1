"""Copies between vLLM's paged KV / state tensors and hybridkv's shared RAM slots.

A hybridkv page of a group is the bytes of one vLLM block over every layer of the group,
layer after layer in the group's order. Each layer tensor has one dimension of size
``num_blocks`` (first on CPU, second in some GPU layouts); its other dimensions are one
block's content. Padding of a page (vLLM pads state pages to the attention page size) is
never copied: the tensors vLLM registers are views without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import Layout
from hybridkv.ram.regions import SharedRegion


@dataclass(frozen=True)
class _Part:
    tensor: torch.Tensor
    block_dim: int
    offset: int          # bytes into the page
    nbytes: int          # bytes of one block


def _tensors(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _block_dim(t: torch.Tensor, num_blocks: int, layer: str) -> int:
    dims = [d for d, size in enumerate(t.shape) if size == num_blocks]
    if not dims:
        raise HybridKVError(
            f"vLLM KV tensor of layer {layer} has shape {tuple(t.shape)} with no dimension of "
            f"num_blocks={num_blocks}; this vLLM version's cache layout is not supported")
    return dims[0]


class PagedCopier:
    """Per group, where each layer's block lives in the page; built once at register time."""

    def __init__(self, layout: Layout, kv_caches: Mapping[str, object], num_blocks: int):
        self.parts: dict[int, list[_Part]] = {}
        for group in layout.cacheable_groups:
            parts, offset = [], 0
            for layer in group.layers:
                if layer not in kv_caches:
                    raise HybridKVError(f"vLLM registered no KV tensor for layer {layer} of group {group.id}")
                for t in _tensors(kv_caches[layer]):
                    dim = _block_dim(t, num_blocks, layer)
                    nbytes = t.select(dim, 0).numel() * t.element_size()
                    parts.append(_Part(t, dim, offset, nbytes))
                    offset += nbytes
            if offset != group.page_bytes:
                raise HybridKVError(
                    f"vLLM's tensors of group {group.id} hold {offset} B per block but its spec "
                    f"says {group.page_bytes} B; this model's cache layout is not supported")
            self.parts[group.id] = parts

    def save(self, group: int, region: SharedRegion, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """vLLM blocks -> RAM slots (after the forward that computed them)."""
        ram = torch.from_numpy(region.array)
        ids, where = torch.tensor(blocks, dtype=torch.long), torch.tensor(slots, dtype=torch.long)
        for p in self.parts[group]:
            data = p.tensor.index_select(p.block_dim, ids).movedim(p.block_dim, 0).contiguous()
            ram[where, p.offset:p.offset + p.nbytes] = data.reshape(len(blocks), -1).view(torch.uint8)

    def load(self, group: int, region: SharedRegion, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """RAM slots -> vLLM blocks (before the forward that reads them)."""
        ram = torch.from_numpy(region.array)
        ids, where = torch.tensor(blocks, dtype=torch.long), torch.tensor(slots, dtype=torch.long)
        for p in self.parts[group]:
            raw = ram[where, p.offset:p.offset + p.nbytes].contiguous()
            block_shape = p.tensor.select(p.block_dim, 0).shape
            data = raw.view(p.tensor.dtype).reshape(len(blocks), *block_shape).movedim(0, p.block_dim)
            p.tensor.index_copy_(p.block_dim, ids, data)
