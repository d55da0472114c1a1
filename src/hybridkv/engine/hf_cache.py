"""Reads pages out of, and rebuilds, a transformers ``DynamicCache`` for hybrid models.

Group 0 holds the K/V of every full-attention layer for one block; group 1 the conv and
recurrent state of every recurrent layer at one boundary. Each tensor sits at a 64-byte
aligned offset in the page so a restore can view the bytes as the tensor's dtype.
Recurrent state keeps its own dtype (fp32 even in bf16 models) so restores stay bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import Group, GroupKind, Layout, TensorSpec

ALIGN = 64
ATTENTION_GROUP, STATE_GROUP = 0, 1


@dataclass(frozen=True)
class Part:
    """One tensor of one layer inside a page."""

    layer: int
    name: str          # "k", "v", "conv" or "recurrent"
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def _pack(specs: list[tuple[int, str, tuple[int, ...], torch.dtype]]) -> tuple[list[Part], int]:
    parts, offset = [], 0
    for layer, name, shape, dtype in specs:
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        part = Part(layer, name, shape, dtype, offset, nbytes)
        parts.append(part)
        offset += -(-part.nbytes // ALIGN) * ALIGN
    return parts, offset


class HFCacheAdapter:
    """Per-model page geometry, learned from one probe forward of ``block_tokens`` tokens."""

    def __init__(self, model, block_tokens: int, model_name: str, revision: str | None = None,
                 engine: str | None = None):
        self.model = model
        self.B = block_tokens
        cache = self.new_cache()
        for layer in cache.layers:
            if getattr(layer, "is_sliding", False):
                raise HybridKVError(
                    f"{model_name} has sliding-window layers, which the reference engine does not "
                    "cache yet; use a model without them"
                )
        with torch.no_grad():
            ids = torch.full((1, block_tokens), 3, dtype=torch.long)
            model(input_ids=ids, position_ids=torch.arange(block_tokens)[None], cache=cache,
                  use_cache=True, logits_to_keep=1)
        attn, state = [], []
        for i, layer in enumerate(cache.layers):
            keys = getattr(layer, "keys", None)
            if torch.is_tensor(keys) and keys.numel():
                _, heads, _, dim = keys.shape
                attn.append((i, "k", (1, heads, block_tokens, dim), keys.dtype))
                values = layer.values
                attn.append((i, "v", (1, values.shape[1], block_tokens, values.shape[3]), values.dtype))
            conv = getattr(layer, "conv_states", {}).get(0) if hasattr(layer, "conv_states") else None
            if conv is not None:
                state.append((i, "conv", tuple(conv.shape), conv.dtype))
                rec = layer.recurrent_states.get(0)
                if rec is not None:
                    state.append((i, "recurrent", tuple(rec.shape), rec.dtype))
        if not attn:
            raise HybridKVError(f"{model_name} has no attention layer; nothing to page")
        self.attention_parts, attention_bytes = _pack(attn)
        self.state_parts, state_bytes = _pack(state)
        groups = [Group(ATTENTION_GROUP, GroupKind.ATTENTION, attention_bytes,
                        layers=tuple(f"layers.{i}" for i in sorted({p.layer for p in self.attention_parts})),
                        tensors=tuple(TensorSpec(f"{p.layer}.{p.name}", p.shape, str(p.dtype))
                                      for p in self.attention_parts))]
        if self.state_parts:
            groups.append(Group(STATE_GROUP, GroupKind.STATE, state_bytes,
                                layers=tuple(f"layers.{i}" for i in sorted({p.layer for p in self.state_parts})),
                                tensors=tuple(TensorSpec(f"{p.layer}.{p.name}", p.shape, str(p.dtype))
                                              for p in self.state_parts)))
        config = model.config
        self.layout = Layout(
            model=model_name, block_tokens=block_tokens, groups=tuple(groups),
            max_model_len=getattr(config, "max_position_embeddings", None),
            revision=revision, dtype=str(next(model.parameters()).dtype), engine=engine,
        )

    def new_cache(self):
        """An empty cache object of the model's own kind."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    # -- reading pages out of a live cache ------------------------------------------------
    def attention_page(self, cache, block: int) -> np.ndarray:
        """K/V of every attention layer for block ``block`` (just computed)."""
        page = torch.empty(self.layout.group(ATTENTION_GROUP).page_bytes, dtype=torch.uint8)
        s, e = block * self.B, (block + 1) * self.B
        for p in self.attention_parts:
            layer = cache.layers[p.layer]
            src = (layer.keys if p.name == "k" else layer.values)[:, :, s:e, :]
            page[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape).copy_(src)
        return page.numpy()

    def state_page(self, cache) -> np.ndarray:
        """The full conv + recurrent state of every recurrent layer, now."""
        page = torch.empty(self.layout.group(STATE_GROUP).page_bytes, dtype=torch.uint8)
        for p in self.state_parts:
            layer = cache.layers[p.layer]
            src = layer.conv_states[0] if p.name == "conv" else layer.recurrent_states[0]
            page[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape).copy_(src)
        return page.numpy()


class RestoredCache:
    """A restore's K/V, filled as pages reach RAM (``Connector.load``'s ``on_pages``): each
    page is copied once, from its slot straight into the final [1, heads, blocks*B, dim]
    tensor of every attention part, while later pages are still being read. On a GPU those
    tensors are host memory and move to the device in one copy each when the load is built."""

    def __init__(self, adapter: HFCacheAdapter, blocks: int, device: torch.device | None = None):
        self.adapter, self.blocks = adapter, blocks
        self.device = device or torch.device("cpu")
        self._parts: list[tuple[Part, torch.Tensor, np.ndarray]] = []
        for p in adapter.attention_parts:
            _, heads, block, dim = p.shape
            tensor = torch.empty((1, heads, blocks * block, dim), dtype=p.dtype)
            # seen as bytes [heads, blocks, B*dim*size]: pages hold [heads, B, dim]
            self._parts.append((p, tensor, tensor.view(torch.uint8).numpy().reshape(heads, blocks, p.nbytes // heads)))
        # the cache object is built now, while the reads run: only the state waits for them
        self.cache = adapter.new_cache()
        for layer, kv in self._by_layer(blocks).items():
            # transformers concatenates onto what a layer holds (a second copy): initialize
            # the layer through its own update with no tokens, then hand it our tensors
            self.cache.update(kv["k"][:, :, :0].to(self.device), kv["v"][:, :, :0].to(self.device), layer)
            self.cache.layers[layer].keys, self.cache.layers[layer].values = kv["k"], kv["v"]

    def add(self, group: int, blocks: list[int], pages: np.ndarray) -> None:
        """Copy in the attention pages (``pages``' rows) of ``blocks``, adjacent and ascending
        as ``Connector.load`` hands them over: one copy per part. Other groups' pages are not
        kept (the state comes from the load's final views: only the last attempt's state
        counts)."""
        if group != ATTENTION_GROUP:
            return
        first, n = blocks[0], len(blocks)
        for p, _, dest in self._parts:
            rows = pages[:, p.offset:p.offset + p.nbytes].reshape(n, dest.shape[0], -1)
            np.copyto(dest[:, first:first + n], rows.transpose(1, 0, 2))

    def _by_layer(self, blocks: int) -> dict[int, dict[str, torch.Tensor]]:
        """Each attention layer's K and V tensors holding the first ``blocks`` blocks."""
        by_layer: dict[int, dict[str, torch.Tensor]] = {}
        for p, tensor, _ in self._parts:
            if blocks < self.blocks:
                tensor = tensor[:, :, :blocks * self.adapter.B].clone()
            by_layer.setdefault(p.layer, {})[p.name] = tensor
        return by_layer

    def build(self, blocks: int, state_page: np.ndarray | None):
        """The model's cache object holding the first ``blocks`` blocks (a load that shrank
        its hit returns fewer than were allocated) and the state at their end."""
        adapter, cache = self.adapter, self.cache
        if blocks < self.blocks or self.device.type != "cpu":
            for layer, kv in self._by_layer(blocks).items():
                cache.layers[layer].keys = kv["k"].to(self.device)
                cache.layers[layer].values = kv["v"].to(self.device)
        if state_page is not None and adapter.state_parts:
            page = torch.from_numpy(np.asarray(state_page))
            for p in adapter.state_parts:     # conv first: it marks the layer as having state
                tensor = page[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape).to(self.device, copy=True)
                if p.name == "conv":
                    cache.update_conv_state(tensor, p.layer, conv_kernel_size=p.shape[-1])
                else:
                    cache.update_recurrent_state(tensor, p.layer)
        return cache
