"""The cache an engine talks to: RAM pools over shared regions, then secondary tiers.

RAM is primary. A stored page is copied into a RAM slot and written through to every
secondary tier in the background (its slot stays pinned until then); a spare page (a state
nobody asked to keep, in a free slot) is written through only once a hit uses it or a store
asks for it. A page only a secondary
tier holds is promoted into RAM first and served from there (``promotion.py``).

``PageCache`` is the whole contract an engine-side caller uses (the connector, the vLLM
scheduler side, the reference engine, the simulator), in the shape of vLLM's offloading
manager: look up, prepare/complete a load, prepare/complete a store, touch, poll, stats.
``TieredCache`` implements it.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from hybridkv.config import CacheConfig
from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import GroupKind, Layout
from hybridkv.core.planner import Plan, default_reference_tokens, plan_pools
from hybridkv.promotion import Load, Promotion, Promotions, TierCounters
from hybridkv.ram.arena import Arena
from hybridkv.ram.grouped_pools import GroupedPools
from hybridkv.ram.policies import EvictionPolicy
from hybridkv.ram.pool import Lookup, StorePlan
from hybridkv.ram.regions import (
    MAP_AHEAD_BYTES,
    PagelessRegion,
    PinHook,
    RegionView,
    SharedRegion,
    remove_stale_regions,
)
from hybridkv.ram.relocation import copy_moves
from hybridkv.tiers.base import SecondaryTier, open_tiers
from hybridkv.tiers.io_queue import batches_of, outcomes

log = logging.getLogger(__name__)
TIER_READY_WAIT_S = 10.0     # at start-up, how long a tier may take to see what it holds
RAM = "ram"


@dataclass
class _WriteThrough:
    group: int
    key: bytes
    futures: list[Future] = field(default_factory=list)


class _RegionsInMaking:
    """The regions of a new plan, made on a thread of their own (or at once: page-less ones)."""

    def __init__(self, plan: Plan, make: Callable[[Plan], dict], background: bool):
        self.plan = plan
        self.regions: dict | None = None
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._make, args=(make,), name="hybridkv-replan", daemon=True)
        if background:
            self._thread.start()
        else:
            self._make(make)

    def _make(self, make: Callable[[Plan], dict]) -> None:
        try:
            self.regions = make(self.plan)
        except Exception as e:       # handed to the engine's thread by replan
            self.error = e

    def ready(self) -> bool:
        return not self._thread.is_alive()

    def discard(self) -> None:
        if self._thread.ident is not None:
            self._thread.join()
        for region in (self.regions or {}).values():
            region.close()


class PageCache(Protocol):
    """What an engine-side caller may use of the cache; pages are named by (group, key).

    A load: ``lookup`` where each page is, ``prepare_load`` pins the RAM pages and starts
    reading the rest into RAM (a ``Load``, ``ready()`` once nothing is left to wait for),
    ``arrivals`` yields pages as they land, ``complete_load`` waits and returns views (or
    None: a page did not arrive, look again), ``release`` unpins. A store: ``prepare_store``
    reserves slots in every group or none, the caller fills them (``write``, or a process
    mapping ``regions``), ``complete_store`` publishes (or abandons) and writes through
    (a spare page: once used, see ``TieredCache.touch``).
    Pins taken for a request between ``request_started`` and ``request_finished`` are
    released by the latter, whatever happened to the request."""

    layout: Layout
    config: CacheConfig
    plan: Plan           # how RAM is split between groups (over an arena: where the split starts)
    regions: Mapping[int, SharedRegion | RegionView | PagelessRegion]   # a worker process maps them by path

    @property
    def tier_names(self) -> list[str]: ...
    def request_started(self, request: str) -> None: ...
    def request_finished(self, request: str) -> int: ...
    def lookup(self, group: int, keys: Sequence[bytes], *, ram: bool = True,
               below_ram: bool = True, prefix: bool = False) -> list[str | None]: ...
    def prefetch(self, group: int, keys: Sequence[bytes], where: Sequence[str | None]) -> int: ...
    def prepare_load(self, wanted: Mapping[int, Sequence[bytes]], request: str | None = None,
                     where: Mapping[int, Sequence[str | None]] | None = None) -> Load | None: ...
    def arrivals(self, load: Load) -> Iterator[tuple[int, list[int], np.ndarray]]: ...
    def complete_load(self, load: Load) -> dict[int, list[np.ndarray]] | None: ...
    def release(self, load: Load) -> None: ...
    def touch(self, wanted: Mapping[int, Sequence[bytes]]) -> None: ...
    def prepare_store(self, keys: Mapping[int, Sequence[bytes]], cold: bool = False,
                      spare: bool = False) -> dict[int, StorePlan] | None: ...
    def free_slots(self, group: int) -> int: ...
    @property
    def shared_ram_bytes(self) -> int | None: ...
    def write(self, group: int, slot: int, page) -> None: ...
    def complete_store(self, plans: Mapping[int, StorePlan], ok: bool = True) -> None: ...
    def poll(self) -> int: ...
    def drain(self) -> None: ...
    def wait_written(self, timeout: float) -> bool: ...
    def forget_ram(self) -> int: ...
    def replan(self, reference_tokens: int) -> bool: ...
    def stats(self) -> dict: ...
    def close(self) -> None: ...


def store_pages(cache: PageCache, pages: Mapping[int, Sequence[tuple[bytes, np.ndarray]]], cold: bool = False,
                spare: bool = False) -> bool:
    """Store pages the caller holds, in every group or none: reserve, copy, publish.
    False: RAM has no room now (nothing changed; retry later)."""
    plans = cache.prepare_store({gid: [key for key, _ in items] for gid, items in pages.items()}, cold, spare)
    if plans is None:
        return False
    for gid, plan in plans.items():
        data = dict(pages[gid])
        for key, slot in zip(plan.keys, plan.slots, strict=True):
            cache.write(gid, slot, data[key])
    cache.complete_store(plans)
    return True


class TieredCache:
    """``PageCache`` over RAM pools and the secondary tiers the config names.

    ``secondaries`` replaces the tiers the config names (tests, benchmarks); ``pin_hook`` runs
    on every RAM region at creation (the engine passes CUDA host registration on a GPU box);
    ``pageless`` keeps the slots and their accounting without the bytes (the simulator);
    ``eviction`` builds each pool's policy instead of the config's named one (the simulator's
    policy comparison); ``pools`` builds the pools from the plan's slots instead (the
    simulator's shared-budget bound).
    """

    def __init__(self, layout: Layout, config: CacheConfig, plan: Plan | None = None,
                 secondaries: Sequence[SecondaryTier] | None = None,
                 pin_hook: PinHook | None = None, pageless: bool = False,
                 eviction: Callable[[int, int], EvictionPolicy] | None = None,
                 pools: Callable[[dict[int, int]], GroupedPools] | None = None):
        self.layout, self.config = layout, config
        reference = config.reference_tokens or default_reference_tokens(layout)
        self.plan = plan or self._plan(reference)
        slots = self.plan.slots_per_group()
        states = [g.id for g in layout.cacheable_groups if g.kind is GroupKind.STATE]
        # a policy of the caller's, or ARC (it sizes its lists by a fixed capacity): a static split
        self._share = config.ram_split == "shared" and config.eviction == "lru" and eviction is None
        self.pools = pools(slots) if pools else GroupedPools(slots, eviction or config.eviction, states,
                                                             self._arena(self.plan))
        self.regions: dict[int, SharedRegion | RegionView | PagelessRegion] = {}
        self.secondaries: list[SecondaryTier] = []
        self.counters: dict[str, TierCounters] = {RAM: TierCounters()}
        self._writes: list[_WriteThrough] = []
        self._spares: dict[int, set[bytes]] = {}          # spare pages not written through (yet)
        self.promotions = Promotions(self.pools, self.regions, self.counters, self.secondaries)
        self._pin_hook, self._pageless = pin_hook, pageless
        self._coming: _RegionsInMaking | None = None       # a re-plan's regions, being made
        self._segments_asked: tuple | None = None          # what _map_ahead last asked for
        try:
            # the tiers first: a store's start-up scan then runs while RAM is allocated
            # (20 ms for 64 MiB), not while the first request waits for it
            self.secondaries += secondaries if secondaries is not None else open_tiers(layout, config)
            self.regions.update(self._make_regions(self.plan))
            for tier in self.secondaries:
                self.counters[tier.name] = TierCounters()
                if not pageless:  # a restart's first request finds what the store holds
                    tier.wait_ready(TIER_READY_WAIT_S)
        except BaseException:
            self.close()
            raise

    @property
    def tier_names(self) -> list[str]:
        """RAM first, then the secondary tiers in lookup order (the values of ``lookup``)."""
        return list(self.counters)

    @property
    def shared_ram_bytes(self) -> int | None:
        """Bytes RAM's groups draw on together (``ram_split = shared``), or None: each group
        keeps the slots the plan gave it."""
        return self.pools.shared_bytes

    def _arena(self, plan: Plan) -> Arena | None:
        """The budget the groups share under ``plan``, or None: a static split (ram_split =
        static, a policy other than LRU, or a layout or budget ``Arena.for_plan`` refuses)."""
        return Arena.for_plan(plan, self.layout) if self._share else None

    def _make_regions(self, plan: Plan) -> dict[int, SharedRegion | RegionView | PagelessRegion]:
        """The regions of ``plan``, all or none: one per group, or one arena that each group
        sees as rows of its own page size."""
        arena = self._arena(plan)
        slots = plan.slots_per_group() if arena is None else {gid: arena.view_rows(gid) for gid in arena.owned}
        if self._pageless:
            return {gid: PagelessRegion(n, self.layout.group(gid).page_bytes) for gid, n in slots.items()}
        directory = Path(self.config.ram_dir)
        if not directory.is_dir():
            raise HybridKVError(f"ram_dir {directory} does not exist; create it or choose another")
        remove_stale_regions(directory)
        tag = f"{self.layout.fingerprint()[:12]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if arena is not None:
            base = SharedRegion.create(directory / f"hybridkv-{tag}-arena", arena.segments, arena.segment_bytes,
                                       self._pin_hook, self.layout.tp_rank)
            return {gid: base.view(self.layout.group(gid).page_bytes) for gid in slots}
        made: dict[int, SharedRegion | PagelessRegion] = {}
        try:
            for gid, slots in plan.slots_per_group().items():
                page = self.layout.group(gid).page_bytes
                made[gid] = SharedRegion.create(directory / f"hybridkv-{tag}-g{gid}", slots, page,
                                                self._pin_hook, self.layout.tp_rank)
        except BaseException:
            for region in made.values():
                region.close()
            raise
        return made

    def _plan(self, reference_tokens: int) -> Plan:
        """The config's pools for prompts of ``reference_tokens`` (its retention resolved
        against the layout's block, the one the cache works in)."""
        config = self.config
        return plan_pools(self.layout, config.ram_bytes, config.retention_tokens(self.layout.block_tokens),
                          reference_tokens, config.engine_block_tokens, config.tail_states)

    def replan(self, reference_tokens: int) -> bool:
        """Split RAM for prompts of ``reference_tokens`` instead. Where the groups share one
        budget (``shared_ram_bytes``) only the plan changes: the split already follows the
        traffic, and what the plan still sizes is the connector's shadows; no page is dropped,
        True at once. Split statically: new pools and regions, the RAM pages dropped (a
        secondary tier keeps what was written through). That takes two calls at least: the
        first starts making the new regions on a thread of its own (zeroing gigabytes on the
        engine's thread would stall it for seconds); a later one, once they are made and no RAM
        page is pinned, being written or read into, swaps them in and returns True. Until then
        it returns False and changes nothing. Raises ``HybridKVError`` when the regions cannot
        be made (e.g. too little room for old and new at once); nothing changed then."""
        if self.shared_ram_bytes is not None:
            self.plan = self._plan(reference_tokens)
            return True
        coming = self._coming
        if coming is None or coming.plan.reference_tokens != reference_tokens:
            if coming is not None:
                coming.discard()
            self._coming = coming = _RegionsInMaking(self._plan(reference_tokens), self._make_regions,
                                                     background=not self._pageless)
        if not coming.ready():
            return False
        if coming.error is not None:
            self._coming = None
            raise HybridKVError(f"cannot re-plan RAM: {coming.error}") from coming.error
        if self._writes or self.promotions.in_flight() or not self.pools.idle():
            return False
        self._coming = None
        for region in self.regions.values():
            region.close()
        self.regions.clear()
        self.regions.update(coming.regions)
        self.plan = coming.plan
        self.pools.resize(coming.plan.slots_per_group(), self._arena(coming.plan))
        self._spares.clear()
        return True

    # -- requests ---------------------------------------------------------------------------
    def request_started(self, request: str) -> None:
        """Pins taken for ``request`` from now on are released at ``request_finished``."""
        self.pools.request_started(request)

    def request_finished(self, request: str) -> int:
        """Release every pin the request still holds (finish, abort, preemption); returns the
        number that leaked."""
        for tier in self.secondaries:
            tier.flush()          # the request's pages are complete: no reason to hold them
        self.promotions.forget_request(request)     # nothing to pin for it any more
        return self.pools.request_finished(request)

    def touch(self, wanted: Mapping[int, Sequence[bytes]]) -> None:
        """Refresh recency; callers touch a prefix after its tail so the prefix outlives it.
        A spare page a hit used is now worth keeping: it is written through."""
        self.pools.touch(wanted)
        if self._spares:
            self._keep_spares(wanted)

    def _keep_spares(self, keys: Mapping[int, Sequence[bytes]]) -> None:
        """Spare pages among ``keys`` that are still in RAM become ordinary ones: written
        through to the secondary tiers, as any stored page is."""
        kept: dict[int, list[bytes]] = {}
        for gid, ks in keys.items():
            spares = self._spares.get(gid)
            if spares:
                for key in ks:
                    if key in spares:
                        spares.discard(key)
                        if self.pools.pool(gid).lookup(key) is Lookup.HIT:
                            kept.setdefault(gid, []).append(key)
        if kept:
            self._write_through(kept)

    # -- where is a page? -------------------------------------------------------------------
    def lookup(self, group: int, keys: Sequence[bytes], *, ram: bool = True,
               below_ram: bool = True, prefix: bool = False) -> list[str | None]:
        """The tier holding each key (RAM first, then the fastest secondary), or None.
        ``below_ram=False`` asks RAM only and ``ram=False`` the secondary tiers only (one
        batch each), for callers that consult the slower tiers about a few keys later.
        ``prefix``: only the run of keys from the first is of use (attention pages), so the
        slower tiers are first asked about the first key RAM lacks alone, and where none
        holds it, about nothing after it (a miss asks them about one key, not the prompt's)."""
        where: list[str | None] = [None] * len(keys)
        if ram:
            pool = self.pools.pool(group)
            where = [RAM if pool.lookup(k) is Lookup.HIT else None for k in keys]
            self.counters[RAM].misses += where.count(None)
        if not below_ram:
            return where
        if prefix and None in where:
            first = where.index(None)
            probe: list[str | None] = [None]
            self._ask_secondaries(group, [keys[first]], probe)
            if probe[0] is None:          # keys past it are of no use: RAM's answers stand
                return where
            where[first] = probe[0]
        self._ask_secondaries(group, keys, where)
        return where

    def _ask_secondaries(self, group: int, keys: Sequence[bytes], where: list[str | None]) -> None:
        """Fill in ``where`` (one entry a key) for the keys it has no tier for: one batch a tier."""
        for tier in self.secondaries:
            missing = [i for i, w in enumerate(where) if w is None]
            if not missing:
                break
            found = tier.contains_many(group, [keys[i] for i in missing])
            for i, ok in zip(missing, found, strict=True):
                if ok:
                    where[i] = tier.name
            self.counters[tier.name].misses += len(missing) - sum(found)

    # -- loads ------------------------------------------------------------------------------
    def prepare_load(self, wanted: Mapping[int, Sequence[bytes]], request: str | None = None,
                     where: Mapping[int, Sequence[str | None]] | None = None) -> Load | None:
        """Pin the wanted pages RAM holds and start reading the others into RAM; returns at
        once (``Load.ready`` says when ``complete_load`` will not wait). None (nothing
        pinned) when a page is gone, half-written, or RAM refused: the caller looks again.
        ``where`` is the tier of each wanted page as the caller just looked it up: pages it
        puts in a secondary tier are read from there without a second lookup.

        Pages already in RAM are pinned first, so promoting the rest cannot evict them; a
        page another request is promoting is waited for, not read twice."""
        resident: dict[int, list[bytes]] = {}
        missing: dict[int, list[bytes]] = {}
        sources: dict[tuple[int, bytes], str | None] = {}
        joined: dict[Promotion, dict[int, list[bytes]]] = {}
        for gid, keys in wanted.items():
            pool = self.pools.pool(gid)
            tiers = where[gid] if where is not None else [None] * len(keys)
            for key, tier in zip(keys, tiers, strict=True):
                state = pool.lookup(key)
                if state is Lookup.HIT:
                    resident.setdefault(gid, []).append(key)
                elif state is Lookup.MISS:
                    missing.setdefault(gid, []).append(key)
                    sources[(gid, key)] = tier if tier != RAM else None
                elif (promotion := self.promotions.of(gid, key)) is not None:
                    joined.setdefault(promotion, {}).setdefault(gid, []).append(key)
                else:                     # the engine is still writing it
                    return None
        self.pools.prepare_load(resident, request)
        load = Load({gid: list(keys) for gid, keys in wanted.items()}, request, resident, joined)
        # wait on the joined reads before making room for the rest: that may drain, and a
        # drain settles them, pinning their pages for their waiters (else it publishes them
        # unpinned, and making room could evict them)
        for promotion in joined:
            promotion.waiters.append(load)
        if missing:
            promotion = self._promote(missing, sources)
            if promotion is None:
                self.release(load)
                return None
            load.waiting[promotion] = missing
            promotion.waiters.append(load)
        load.slots = {gid: [self.pools.slot_of(gid, k) for k in keys] for gid, keys in load.wanted.items()}
        self.counters[RAM].hits += sum(len(k) for k in resident.values())
        return load

    def arrivals(self, load: Load) -> Iterator[tuple[int, list[int], np.ndarray]]:
        """The load's pages as they reach RAM (see ``Promotions.arrivals``)."""
        return self.promotions.arrivals(load)

    def complete_load(self, load: Load) -> dict[int, list[np.ndarray]] | None:
        """Wait for the load's promotions and return views of its pages, all pinned until
        ``release``; None when one did not arrive (its pins are then released)."""
        for promotion in list(load.waiting):
            self.promotions.settle(promotion)
        if load.failed:
            self.release(load)
            return None
        views = {}
        for gid, slots in load.slots.items():
            region = self.regions[gid]
            views[gid] = [region.page(slot) for slot in slots]
            self.counters[RAM].bytes_out += len(slots) * region.page_bytes
        return views

    def release(self, load: Load) -> None:
        """Unpin what the load holds and stop waiting for the rest (finished, aborted or
        failed, in any state)."""
        for promotion in load.waiting:
            promotion.waiters = [other for other in promotion.waiters if other is not load]
        load.waiting = {}
        self.pools.complete_load(load.pinned, load.request)
        load.pinned = {}

    def prefetch(self, group: int, keys: Sequence[bytes], where: Sequence[str | None]) -> int:
        """Start reading into RAM the pages ``where`` puts in a secondary tier and RAM lacks,
        pinning nothing; returns how many. A load that wants them later waits for these
        reads instead of starting its own, and ``poll`` publishes pages nobody waited for.
        For a caller still keying the rest of a prompt: its first pages are on their way."""
        pool = self.pools.pool(group)
        missing = [key for key, tier in zip(keys, where, strict=True)
                   if tier is not None and tier != RAM and pool.lookup(key) is Lookup.MISS]
        sources = {(group, key): tier for key, tier in zip(keys, where, strict=True)}
        if not missing or self._promote({group: missing}, sources, drain=False) is None:
            return 0            # no room now: the load makes room (it may wait for writes)
        return len(missing)

    def _promote(self, missing: Mapping[int, Sequence[bytes]],
                 sources: dict[tuple[int, bytes], str | None], drain: bool = True) -> Promotion | None:
        """Reserve RAM slots for pages only secondary tiers hold and start reading each from
        the tier ``sources`` names, or else the first tier holding it. Short of room,
        ``drain`` waits for the write-throughs that pin slots and tries again."""
        for gid, keys in missing.items():
            unknown = [key for key in keys if sources[(gid, key)] is None]
            for key, tier in zip(unknown, self.lookup(gid, unknown, ram=False), strict=True):
                if tier is None:
                    return None
                sources[(gid, key)] = tier
        plans = self._prepare(missing)
        if plans is None and drain and self._writes:
            # Slots pinned only by write-through free up once those writes land: waiting for
            # them is bounded and far cheaper than recomputing the prefix.
            self.drain()
            plans = self._prepare(missing)
        return None if plans is None else self.promotions.start(plans, sources)

    def _prepare(self, keys: Mapping[int, Sequence[bytes]], cold: bool = False,
                 spare: bool = False) -> dict[int, StorePlan] | None:
        """The pools' ``prepare_store``, then the copies of the pages it moved within the arena
        to give another kind room (idle pages: no worker reads or writes them meanwhile)."""
        plans = self.pools.prepare_store(keys, cold, spare)
        transfers = self.pools.take_relocated()
        if not self._pageless:
            for moved in transfers:                     # one transfer after the other
                copy_moves([(self.regions[gid], src, dst) for gid, src, dst in moved])
        return plans

    # -- stores -----------------------------------------------------------------------------
    def prepare_store(self, keys: Mapping[int, Sequence[bytes]], cold: bool = False,
                      spare: bool = False) -> dict[int, StorePlan] | None:
        """Claim RAM slots for the absent keys, atomically across groups (None: no room now,
        nothing changed; retry later). Keys already present or in flight are skipped. The
        caller fills the slots (``write``, or a worker process through the shared region)
        and ends every reservation with ``complete_store``. ``cold``: the pages are evicted
        before older ones unless a hit uses them (a request the insertion policy expects no
        reuse of). ``spare``: pages nobody asked to keep, taken only into free room (cold,
        evicting nothing; see ``free_slots``) and kept in RAM only until a hit uses them or a
        store asks for them (then written through)."""
        keys = {gid: list(ks) for gid, ks in keys.items() if ks}
        if not keys:
            return {}
        if not spare and self._spares:     # a page stored as spare is now asked for
            self._keep_spares(keys)
        plans = self._prepare(keys, cold, spare)
        if plans is None and self._writes and not spare:
            for tier in self.secondaries:   # RAM is short: held write-through keeps slots pinned
                tier.flush()
        return plans

    def free_slots(self, group: int) -> int:
        """RAM slots a store to ``group`` could fill without evicting a page (over an arena,
        with segments its kind could take from free room): a spare store fits."""
        return self.pools.free_slots(group)

    def write(self, group: int, slot: int, page) -> None:
        """Copy one page into a slot ``prepare_store`` reserved."""
        self.regions[group].write(slot, page)

    def complete_store(self, plans: Mapping[int, StorePlan], ok: bool = True) -> None:
        """The reserved slots are filled (ok: published, then written through to every
        secondary tier in the background, pinned until written; spare pages only once used)
        or abandoned (freed)."""
        done = {gid: plan.keys for gid, plan in plans.items() if plan.keys}
        if not ok:
            self.pools.complete_store(done, False)
            return
        ram = self.counters[RAM]
        for gid, keys in done.items():
            ram.bytes_in += len(keys) * self.regions[gid].page_bytes
        self.pools.complete_store(done)
        if self.secondaries:
            for gid, keys in done.items():
                if plans[gid].spare:
                    self._spares.setdefault(gid, set()).update(keys)
        self._write_through({gid: keys for gid, keys in done.items() if not plans[gid].spare})

    def _write_through(self, done: Mapping[int, list[bytes]]) -> None:
        """Write these RAM pages to every secondary tier in the background, each pinned until
        its writes finish."""
        if not self.secondaries or not done:
            return
        jobs, items = [], []
        for gid, keys in done.items():
            slots = self.pools.prepare_load({gid: keys})[gid]   # pinned until written
            for key, slot in zip(keys, slots, strict=True):
                jobs.append(_WriteThrough(gid, key))
                items.append((gid, key, self.regions[gid].page(slot)))
        for tier in self.secondaries:
            for job, future in zip(jobs, tier.submit_writes(items), strict=True):
                job.futures.append(future)
            self.counters[tier.name].bytes_in += sum(page.nbytes for _, _, page in items)
        self._writes.extend(jobs)

    def poll(self) -> int:
        """End-of-step: publish promotions whose reads finished (their pages are pinned for
        whoever waits), unpin pages whose write-through finished; returns how many of those."""
        self.promotions.settle_finished()
        if self.secondaries:                          # the slots promotions read into next
            self._map_ahead()
        done, waiting = [], []
        for w in self._writes:
            (done if all(f.done() for f in w.futures) else waiting).append(w)
        self._writes = waiting
        for w in done:
            self.pools.complete_load({w.group: [w.key]})
        return len(done)

    def _map_ahead(self) -> None:
        """Have the slots in use and a window beyond them mapped (``SharedRegion.map_ahead``);
        over an arena, the segments that hold them."""
        arena = self.pools.arena
        if arena is not None:      # what the segments in use depend on: unchanged at most steps
            asked = (arena, arena.moves, *(self.pools.pool(gid).slots_used for gid in self.regions))
            if asked == self._segments_asked:
                return
            self._segments_asked = asked
        for gid, region in self.regions.items():
            used = self.pools.pool(gid).slots_used
            if arena is None or not isinstance(region, RegionView):
                region.map_ahead(used)
            else:
                ahead = -(-MAP_AHEAD_BYTES // region.page_bytes)
                region.base.map_segments(arena.segments_in_use(gid, used + ahead), arena.segment_bytes)

    def drain(self) -> None:
        """Wait for every promotion and write-through (clean shutdown, or before another
        process reads). It runs inside engines' lookups when RAM is short, so a write job
        that failed is logged, never raised: the page is only not stored below RAM."""
        self.promotions.settle_all()
        for tier in self.secondaries:
            tier.flush()
        futures = [f for w in self._writes for f in w.futures]
        wait(batches_of(futures))
        failed = [exc for _, exc in outcomes(futures) if exc is not None]
        if failed:
            log.error("hybridkv: %d background writes failed (first: %r); those pages are not "
                      "stored below RAM", len(failed), failed[0])
        self.poll()

    def forget_ram(self) -> int:
        """Free every RAM page no request is using or writing; returns how many."""
        used = sum(s["used"] for s in self.pools.stats().values())
        self.pools.reset()
        self._spares.clear()
        return used - sum(s["used"] for s in self.pools.stats().values())

    def wait_written(self, timeout: float) -> bool:
        """Wait until the write-throughs started so far have landed (True) or ``timeout``
        passed. Unlike ``drain`` it changes no cache state, so another thread may call it
        while the engine thread goes on (a stop signal's drain)."""
        for tier in self.secondaries:
            tier.flush()
        return not wait(batches_of(f for w in list(self._writes) for f in w.futures), timeout).not_done

    # -- lifecycle --------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per group (kind, slots, use), per tier (RAM first: hits, misses, bytes in and out,
        the tier's own counters), the write-throughs and promotions in flight, the requests
        started and not finished."""
        groups = {}
        for gid, s in self.pools.stats().items():
            groups[gid] = {"kind": self.layout.group(gid).kind, **s}
        tiers = {name: vars(c).copy() for name, c in self.counters.items()}
        for tier in self.secondaries:
            tiers[tier.name].update(tier.stats)
        arena = self.pools.arena
        shared = None if arena is None else {"segments": arena.segments, "segment_bytes": arena.segment_bytes,
                                             "moves": arena.moves, "unowned": len(arena.unowned)}
        return {"groups": groups, "tiers": tiers, "arena": shared, "pending_writes": len(self._writes),
                "promotions_in_flight": len(self.promotions.in_flight()),
                "open_requests": self.pools.open_requests()}

    def close(self) -> None:
        try:
            if self._coming is not None:
                self._coming.discard()
                self._coming = None
            if self.regions:
                self.drain()
        finally:
            for tier in self.secondaries:
                tier.close()
            for region in self.regions.values():
                region.close()
            self.regions.clear()
            self.secondaries.clear()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
