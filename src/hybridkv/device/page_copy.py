"""Copies pages between an engine's paged tensors, on any torch device, and RAM slots.

A page of a group is the bytes of one engine block over every layer of the group, layer after
layer; each layer's block in the *logical* order of its block view (the tensor with the block
as dim 0), whatever the physical order of the engine's memory. So a page's bytes do not change
when the engine picks another physical layout or splits blocks for its kernels; the caller
folds those into the views. Under tensor parallelism every rank owns one byte range of each
page (its heads, its state slice) and copies only that range.

On CPU a copy is one gather or scatter per layer tensor straight between the tensors and the
mapped region. On a GPU it is staged: the layers of a batch are gathered into a device buffer
and moved by DMA per slot (the region is registered with CUDA), on a stream per direction
that first waits for the engine's stream, so the copy sees every kernel queued before it.
The engine's stream then waits only for the gather of a save (the blocks may be reused
after it), never for a transfer to or from host. ``Transfer.done`` says when the host bytes
(a save) or the blocks (a load) are complete. The staged path runs on CPU too
(``staged=True``), so the CPU tests cover the code a GPU runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridkv.core.errors import HybridKVError
from hybridkv.device.pinning import cuda_pin_hook
from hybridkv.ram.regions import SharedRegion

LOAD_STAGING_BYTES = 64 << 20    # device memory a staged load moves at a time (at least one page)
SAVE_STAGING_BYTES = 1 << 30     # a save up to this size is gathered whole (see PageCopier.save)


@dataclass(frozen=True)
class _Part:
    view: torch.Tensor       # [num_blocks, ...] of one layer, any strides
    offset: int              # bytes into this rank's slice of the page
    nbytes: int              # bytes of one block of this layer


class Transfer:
    """A batch of copies in flight; on CPU it is complete when created."""

    def __init__(self, done=None, started=None, seconds: float = 0.0):
        self._done, self._started, self._seconds = done, started, seconds

    def done(self) -> bool:
        return self._done is None or self._done.query()

    def wait(self) -> None:
        if self._done is not None:
            self._done.synchronize()

    def seconds(self) -> float:
        """How long the copies took (on a GPU: on its stream, between the batch's events)."""
        if self._done is None:
            return self._seconds
        return self._started.elapsed_time(self._done) / 1e3


class _Lane:
    """One direction's stream and staging buffer: loads never queue behind saves, and a
    save's gather never waits for a load's transfer."""

    def __init__(self, device: torch.device, cuda: bool):
        self.device, self.cuda = device, cuda
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.buffer: torch.Tensor | None = None

    def staging(self, rows: int, width: int) -> torch.Tensor:
        """``rows`` x ``width`` bytes; a larger buffer replaces a smaller one. The buffer is
        allocated on this lane's stream, so the old one's memory is reused only in this
        stream's order, after the copies still reading it (allocated on the engine's stream,
        the engine's next allocation could take it while a save's transfer still reads it)."""
        if self.buffer is None or self.buffer.numel() < rows * width:
            with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
                self.buffer = torch.empty(rows * width, dtype=torch.uint8, device=self.device)
        return self.buffer[: rows * width].view(rows, width)

    @property
    def reserved_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event


def fold_kernel_blocks(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """An attention cache ``[B*r, H, Nk, C]`` whose engine splits each block into ``r`` kernel
    blocks, seen as ``[B, H, r, Nk, C]``: one block per row, each head's tokens in order."""
    rows = tensor.shape[0]
    if rows == num_blocks:
        return tensor
    if rows % num_blocks or tensor.dim() != 4:
        raise HybridKVError(f"a cache tensor of shape {tuple(tensor.shape)} is neither {num_blocks} blocks "
                            "nor a whole number of kernel blocks per block")
    return tensor.unflatten(0, (num_blocks, rows // num_blocks)).movedim(1, 2)


def block_bytes(views: Sequence[torch.Tensor]) -> int:
    """Bytes one block takes over these block views (a group's slice of a page)."""
    return sum(view[0].numel() * view.element_size() for view in views)


def _typed(rows: torch.Tensor, view: torch.Tensor) -> torch.Tensor | None:
    """``rows`` (bytes, one block a row, each row's bytes contiguous) seen as blocks of
    ``view``'s dtype and shape without copying, or None where the bytes do not line up with
    that dtype (the caller then goes through a contiguous buffer)."""
    try:
        return rows.view(view.dtype).view(rows.shape[0], *view.shape[1:])
    except RuntimeError:             # an offset or stride the dtype's size does not divide
        return None


def _widened(target: torch.Tensor, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1- and 2-byte tensors seen as 8- or 4-byte integers where their layout allows (else as
    they are): the copy is the same bytes, and ``index_copy_`` moves elements. On CPU, 15
    blocks of 32 KiB: int8 (vLLM's state views) 262 -> 38 µs, bf16 67 -> 39 µs; fp32 gains
    nothing and is left alone."""
    if target.element_size() > 2:
        return target, data
    for wide in (torch.int64, torch.int32):
        try:
            return target.view(wide), data.view(wide)
        except RuntimeError:         # a dimension or stride the wider type does not divide
            continue
    return target, data


def slot_rows(slots: Sequence[int]) -> slice | torch.Tensor:
    """The region rows of ``slots``: a slice where they run consecutively (a pool hands out
    fresh slots in order), which torch copies ~3x faster than an index for small pages."""
    first = slots[0] if len(slots) else 0
    if all(s == first + i for i, s in enumerate(slots)):
        return slice(first, first + len(slots))
    return torch.as_tensor(slots, dtype=torch.long)


class PageCopier:
    """Block <-> slot copies of one rank's slice of each group's pages.

    ``views``: per group, one tensor per layer with the block as dim 0 (see the module doc).
    ``page_bytes``: each group's full page, ``ranks`` equal slices of it; this copier owns
    slice ``rank``. ``staged`` defaults to the device's path (see the module doc).
    """

    def __init__(self, views: Mapping[int, Sequence[torch.Tensor]], page_bytes: Mapping[int, int],
                 rank: int = 0, ranks: int = 1, staged: bool | None = None,
                 load_staging_bytes: int = LOAD_STAGING_BYTES, save_staging_bytes: int = SAVE_STAGING_BYTES):
        self.parts: dict[int, list[_Part]] = {}
        self.slice_bytes: dict[int, int] = {}
        devices = set()
        for gid, layer_views in views.items():
            parts, offset = [], 0
            for view in layer_views:
                if view.stride(-1) != 1 and view.shape[-1] > 1:
                    raise HybridKVError(f"group {gid}: a layer tensor's last dimension is not contiguous "
                                        f"(strides {tuple(view.stride())}); this cache layout is not supported")
                nbytes = block_bytes([view])
                parts.append(_Part(view, offset, nbytes))
                offset += nbytes
                devices.add(view.device)
            self.parts[gid], self.slice_bytes[gid] = parts, offset
        if len(devices) > 1:
            raise HybridKVError(f"the KV tensors live on several devices ({sorted(map(str, devices))}); "
                                "one copier serves one device")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.page_bytes = dict(page_bytes)
        self.rank = rank
        for gid, nbytes in self.slice_bytes.items():
            if nbytes * ranks != self.page_bytes[gid]:
                raise HybridKVError(f"group {gid}: rank {rank} holds {nbytes} B per block, which is not "
                                    f"1/{ranks} of the {self.page_bytes[gid]} B page")
        self.cuda = self.device.type == "cuda"
        self.staged = self.cuda if staged is None else staged
        if self.cuda and not self.staged:
            raise HybridKVError("copies on a GPU are staged (staged=False is for CPU tensors only)")
        # each process that copies to a GPU registers its own mapping of a region
        self.pin_hook = cuda_pin_hook() if self.cuda else None
        self._hosts: dict[int, tuple[SharedRegion, torch.Tensor]] = {}
        self._lanes = {"save": _Lane(self.device, self.cuda), "load": _Lane(self.device, self.cuda)}
        self._staging_bytes = {"save": save_staging_bytes, "load": load_staging_bytes}
        largest_load = max((max(1, load_staging_bytes // w) * w for w in self.slice_bytes.values() if w), default=0)
        if self.staged and largest_load:
            # a load the next forward reads cannot fail: its staging buffer is taken now, while
            # the engine starts, at the largest size any group's load uses
            self._lanes["load"].staging(1, largest_load)

    @property
    def load_staging_reserved(self) -> int:
        """Device bytes held for loads from the start (0 on the direct CPU path)."""
        return self._lanes["load"].reserved_bytes

    # -- public ---------------------------------------------------------------------------
    def save(self, group: int, region: SharedRegion, slots: Sequence[int], blocks: Sequence[int]) -> Transfer:
        """Blocks -> slots, after everything the engine queued so far (the forward). On a GPU
        the engine's stream waits for the gather only; a save larger than
        ``save_staging_bytes`` goes in parts, and there it also waits for the earlier
        parts' transfers (the buffer is reused)."""
        host = self._host(group, region)
        if not self.staged:
            t0 = time.perf_counter()
            ids, where = self._ids(blocks), slot_rows(slots)
            for p in self.parts[group]:
                typed = None
                if isinstance(where, slice):    # rows in a run: a view of the slots (else a copy)
                    rows = host[where, p.offset:p.offset + p.nbytes]
                    typed = _typed(rows, p.view) if len(rows) == len(ids) else None
                if typed is not None:       # gathered straight into the slots: one pass, no buffer
                    torch.index_select(p.view, 0, ids, out=typed)
                else:
                    host[where, p.offset:p.offset + p.nbytes] = self._gather(p, ids)
            return Transfer(seconds=time.perf_counter() - t0)
        return self._staged(group, host, slots, blocks, "save")

    def load(self, group: int, region: SharedRegion, slots: Sequence[int], blocks: Sequence[int],
             feeds_forward: bool = False) -> Transfer:
        """Slots -> blocks, after everything the engine queued so far (its zeroing of them).
        ``feeds_forward``: the engine's next kernels read the blocks, so on a GPU its stream
        waits for the copy."""
        host = self._host(group, region)
        if not self.staged:
            t0 = time.perf_counter()
            ids, where = self._ids(blocks), slot_rows(slots)
            for p in self.parts[group]:
                self._scatter(p, ids, host[where, p.offset:p.offset + p.nbytes])
            return Transfer(seconds=time.perf_counter() - t0)
        return self._staged(group, host, slots, blocks, "load", feeds_forward)

    def forget(self, group: int) -> None:
        """Drop the view of the group's region kept for its copies, before the region is
        closed (a live view would keep the old mapping until the group's next copy)."""
        self._hosts.pop(group, None)

    def synchronize(self) -> None:
        """Wait for every copy queued so far (before a failed batch is reported: no copy of
        it may still land in blocks or slots that are about to be reused)."""
        for lane in self._lanes.values():
            if lane.stream is not None:
                lane.stream.synchronize()

    # -- the two paths --------------------------------------------------------------------
    def _host(self, group: int, region: SharedRegion) -> torch.Tensor:
        """This rank's columns of the region's rows (made once per region: a copy is called
        every step, and on small pages making the view was a sixth of its time)."""
        cached = self._hosts.get(group)
        if cached is not None and cached[0] is region:
            return cached[1]
        if region.page_bytes != self.page_bytes[group]:
            raise HybridKVError(f"RAM region of group {group} has {region.page_bytes} B pages but the engine's "
                                f"page is {self.page_bytes[group]} B; the processes disagree on the layout")
        width = self.slice_bytes[group]
        host = torch.from_numpy(region.array)[:, self.rank * width:(self.rank + 1) * width]
        self._hosts[group] = (region, host)      # a re-planned region replaces it
        return host

    def _ids(self, blocks: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(blocks, dtype=torch.long)
        return ids if not self.cuda else ids.to(self.device, non_blocking=True)

    @staticmethod
    def _gather(p: _Part, ids: torch.Tensor) -> torch.Tensor:
        data = p.view.index_select(0, ids)
        return data.reshape(len(ids), -1).view(torch.uint8)

    @staticmethod
    def _scatter(p: _Part, ids: torch.Tensor, raw: torch.Tensor) -> None:
        data = _typed(raw, p.view)      # read in place where the bytes line up, else via a copy
        if data is None:
            data = raw.contiguous().view(p.view.dtype).reshape(len(ids), *p.view.shape[1:])
        target, data = _widened(p.view, data)
        target.index_copy_(0, ids, data)

    def _staged(self, group: int, host: torch.Tensor, slots, blocks, kind: str,
                feeds_forward: bool = False) -> Transfer:
        width, lane, save = self.slice_bytes[group], self._lanes[kind], kind == "save"
        rows = min(len(slots), max(1, self._staging_bytes[kind] // width))
        staging = lane.staging(rows, width)
        engine = torch.cuda.current_stream(self.device) if self.cuda else None
        t0 = time.perf_counter()
        with torch.cuda.stream(lane.stream) if self.cuda else contextlib.nullcontext():
            if self.cuda:
                lane.stream.wait_stream(engine)
            started, read = lane.event(), None
            for start in range(0, len(slots), rows):
                where, ids = slots[start:start + rows], self._ids(blocks[start:start + rows])
                if save:
                    for p in self.parts[group]:
                        staging[:len(ids), p.offset:p.offset + p.nbytes] = self._gather(p, ids)
                    read = lane.event()          # the blocks are read up to here
                for i, slot in enumerate(where):
                    if save:
                        host[slot].copy_(staging[i], non_blocking=self.cuda)
                    else:
                        staging[i].copy_(host[slot], non_blocking=self.cuda)
                if not save:
                    for p in self.parts[group]:
                        self._scatter(p, ids, staging[:len(ids), p.offset:p.offset + p.nbytes])
            done = lane.event()
        if read is not None:         # the engine may overwrite the blocks once they are read
            engine.wait_event(read)
        if feeds_forward:            # the engine reads the blocks once they are written
            engine.wait_event(done)
        return Transfer(done, started, seconds=time.perf_counter() - t0)
