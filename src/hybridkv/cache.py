"""The cache a connector talks to: RAM pools over shared regions, then secondary tiers.

RAM is primary. A page stored here is copied into a RAM slot and written through to every
secondary tier in the background (its slot stays pinned until then). A page found only in
a secondary tier is promoted into RAM first and then served from there; an engine that can
wait without blocking (vLLM) starts the promotion and collects it a step later
(``start_acquire``/``finish_acquire``), one that cannot waits for it (``acquire``).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hybridkv.config import CacheConfig
from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import Layout
from hybridkv.core.planner import Plan, plan_pools
from hybridkv.ram.grouped_pools import GroupedPools
from hybridkv.ram.policies import EvictionPolicy
from hybridkv.ram.pool import Lookup, StorePlan
from hybridkv.ram.regions import PagelessRegion, PinHook, SharedRegion, remove_stale_regions
from hybridkv.tiers.base import SecondaryTier, open_tiers
from hybridkv.tiers.io_queue import batches_of, outcomes

log = logging.getLogger(__name__)
TIER_READY_WAIT_S = 10.0     # at start-up, how long a tier may take to see what it holds
RAM = "ram"


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0        # keys looked up in the tier and not found there
    bytes_in: int = 0      # bytes stored into the tier
    bytes_out: int = 0     # bytes served from the tier


@dataclass
class _WriteThrough:
    group: int
    key: bytes
    futures: list[Future] = field(default_factory=list)


class Promotion:
    """Pages being read from slower tiers into RAM slots reserved for them. The slots are
    write-pending, so nothing serves or evicts them meanwhile; a request wanting one of the
    pages waits on the promotion instead of reading it again. Settled once: each waiting
    acquisition then gets the pages that arrived pinned for it."""

    def __init__(self, jobs: list[tuple[int, bytes, SecondaryTier, Future]]):
        self.jobs = jobs
        self.waiters: list[Acquisition] = []
        self.settled = False
        self._batches = batches_of(future for *_, future in jobs)

    def done(self) -> bool:
        return self.settled or all(batch.done() for batch in self._batches)



@dataclass(eq=False)
class Acquisition:
    """A request's pages: those pinned for it, and those it waits for from promotions."""

    wanted: dict[int, list[bytes]]
    request: str | None
    pinned: dict[int, list[bytes]]
    waiting: dict[Promotion, dict[int, list[bytes]]]
    failed: bool = False          # a page it waited for did not arrive

    def ready(self) -> bool:
        """Would ``finish_acquire`` return without waiting?"""
        return all(promotion.done() for promotion in self.waiting)


class TieredCache:
    """The one object a connector talks to: lookups, loads, stores, request lifetimes.

    ``secondaries`` replaces the tiers the config names (tests, benchmarks); ``pin_hook`` runs
    on every RAM region at creation (the engine passes CUDA host registration on a GPU box);
    ``pageless`` keeps the slots and their accounting without the bytes (the simulator);
    ``eviction`` builds each pool's policy instead of the config's named one (the simulator's
    policy comparison).
    """

    def __init__(self, layout: Layout, config: CacheConfig, plan: Plan | None = None,
                 secondaries: Sequence[SecondaryTier] | None = None,
                 pin_hook: PinHook | None = None, pageless: bool = False,
                 eviction: Callable[[int, int], EvictionPolicy] | None = None):
        self.layout, self.config = layout, config
        reference = config.reference_tokens or layout.max_model_len or 64 * layout.block_tokens
        self.plan = plan or plan_pools(layout, config.ram_bytes, config.retention, reference,
                                       config.engine_block_tokens, config.tail_states)
        self.pools = GroupedPools(self.plan.slots_per_group(), eviction or config.eviction)
        self.regions: dict[int, SharedRegion | PagelessRegion] = {}
        self.secondaries: list[SecondaryTier] = []
        self.counters: dict[str, TierCounters] = {RAM: TierCounters()}
        self._writes: list[_WriteThrough] = []
        self._promotions: dict[tuple[int, bytes], Promotion] = {}    # pages in flight into RAM
        try:
            # the tiers first: a store's start-up scan then runs while RAM is allocated
            # (20 ms for 64 MiB), not while the first request waits for it
            self.secondaries = list(secondaries) if secondaries is not None else open_tiers(layout, config)
            if pageless:
                self.regions = {gid: PagelessRegion(slots, layout.group(gid).page_bytes)
                                for gid, slots in self.plan.slots_per_group().items()}
            else:
                self._open_regions(pin_hook)
            for tier in self.secondaries:
                self.counters[tier.name] = TierCounters()
                if not pageless:  # a restart's first request finds what the store holds
                    tier.wait_ready(TIER_READY_WAIT_S)
        except BaseException:
            self.close()
            raise

    @property
    def tier_names(self) -> list[str]:
        """RAM first, then the secondary tiers in lookup order (the values of ``locate``)."""
        return list(self.counters)

    def _open_regions(self, pin_hook: PinHook | None) -> None:
        directory = Path(self.config.ram_dir)
        if not directory.is_dir():
            raise HybridKVError(f"ram_dir {directory} does not exist; create it or choose another")
        remove_stale_regions(directory)
        tag = f"{self.layout.fingerprint()[:12]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        for gid, slots in self.plan.slots_per_group().items():
            page = self.layout.group(gid).page_bytes
            self.regions[gid] = SharedRegion.create(directory / f"hybridkv-{tag}-g{gid}", slots, page,
                                                    pin_hook, self.layout.tp_rank)

    # -- requests ---------------------------------------------------------------------------
    def request_started(self, request: str) -> None:
        """Pins taken for ``request`` from now on are released at ``request_finished``."""
        self.pools.request_started(request)

    def request_finished(self, request: str) -> int:
        """Release every pin the request still holds (finish, abort, preemption); returns the
        number that leaked."""
        for tier in self.secondaries:
            tier.flush()          # the request's pages are complete: no reason to hold them
        for promotion in set(self._promotions.values()):   # nothing to pin for it any more
            promotion.waiters = [a for a in promotion.waiters if a.request != request]
        return self.pools.request_finished(request)

    def touch(self, wanted: Mapping[int, Sequence[bytes]]) -> None:
        """Refresh recency; callers touch a prefix after its tail so the prefix outlives it."""
        self.pools.touch(wanted)

    # -- where is a page? -------------------------------------------------------------------
    def locate(self, group: int, keys: Sequence[bytes], secondary: bool = True) -> list[str | None]:
        """Tier name holding each key (RAM first), or None. ``secondary=False`` asks RAM only,
        for callers that consult the slower tiers about a few keys later (``locate_below_ram``)."""
        pool = self.pools.pool(group)
        where: list[str | None] = [RAM if pool.lookup(k) is Lookup.HIT else None for k in keys]
        self.counters[RAM].misses += where.count(None)
        if secondary:
            missing = [i for i, w in enumerate(where) if w is None]
            below = self.locate_below_ram(group, [keys[i] for i in missing])
            for i, tier in zip(missing, below, strict=True):
                where[i] = tier
        return where

    def locate_below_ram(self, group: int, keys: Sequence[bytes]) -> list[str | None]:
        """The secondary tier holding each key (the fastest wins), one batch per tier."""
        where: list[str | None] = [None] * len(keys)
        for tier in self.secondaries:
            missing = [i for i, w in enumerate(where) if w is None]
            if not missing:
                break
            found = tier.contains_many(group, [keys[i] for i in missing])
            for i, ok in zip(missing, found, strict=True):
                if ok:
                    where[i] = tier.name
            self.counters[tier.name].misses += len(missing) - sum(found)
        return where

    # -- loads ------------------------------------------------------------------------------
    def acquire(self, wanted: Mapping[int, Sequence[bytes]], request: str | None = None
                ) -> dict[int, list[np.ndarray]] | None:
        """Pin every wanted page in RAM (promoting from secondary tiers, waiting for the
        reads) and return views. None when a page could not be brought into RAM (gone,
        corrupt, or RAM refused): the caller recomputes its hit, which now sees it missing."""
        acquisition = self.start_acquire(wanted, request)
        return None if acquisition is None else self.finish_acquire(acquisition)

    def start_acquire(self, wanted: Mapping[int, Sequence[bytes]], request: str | None = None,
                      where: Mapping[int, Sequence[str | None]] | None = None) -> Acquisition | None:
        """Pin the wanted pages RAM holds and start reading the others into RAM; returns at
        once. None (nothing pinned) when a page is gone, half-written, or RAM refused.
        ``where`` is the tier of each wanted page as the caller just located it (``locate``):
        pages it puts in a secondary tier are read from there without a second lookup.

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
                elif (gid, key) in self._promotions:
                    joined.setdefault(self._promotions[(gid, key)], {}).setdefault(gid, []).append(key)
                else:                     # the engine is still writing it
                    return None
        self.pools.prepare_load(resident, request)
        acquisition = Acquisition({gid: list(keys) for gid, keys in wanted.items()}, request,
                                  resident, joined)
        # wait on the joined reads before making room for the rest: that may drain, and a
        # drain settles them, pinning their pages for their waiters (else it publishes them
        # unpinned, and making room could evict them)
        for promotion in joined:
            promotion.waiters.append(acquisition)
        if missing:
            promotion = self._start_promotion(missing, sources)
            if promotion is None:
                self.release_acquisition(acquisition)
                return None
            acquisition.waiting[promotion] = missing
            promotion.waiters.append(acquisition)
        self.counters[RAM].hits += sum(len(k) for k in resident.values())
        return acquisition

    def finish_acquire(self, acquisition: Acquisition) -> dict[int, list[np.ndarray]] | None:
        """Wait for the acquisition's promotions and return views of its pages, all pinned;
        None when one did not arrive (its pins are then released)."""
        for promotion in list(acquisition.waiting):
            self._settle(promotion)
        if acquisition.failed:
            self.release_acquisition(acquisition)
            return None
        views = {}
        for gid, keys in acquisition.wanted.items():
            region, pool = self.regions[gid], self.pools.pool(gid)
            views[gid] = [region.page(pool.slot_of(k)) for k in keys]
            self.counters[RAM].bytes_out += len(keys) * region.page_bytes
        return views

    def arrivals(self, acquisition: Acquisition) -> Iterator[tuple[int, list[int], np.ndarray]]:
        """The acquisition's pages as they reach RAM: (group, positions in ``wanted[group]``,
        a view of their slots, one page a row), the pinned pages at once, then each batch of
        promoted pages as its read lands, so an engine copies pages while later ones are
        still being read. Each view covers adjacent slots holding adjacent positions, so an
        engine copies a run of pages in one call (one release of the GIL, not one a page:
        beside the I/O threads, a copy that released it per page ran 2x slower). A page
        whose read failed is not yielded; ``finish_acquire`` then fails the load. The views
        stay valid until the acquisition is released."""
        position = {gid: {key: i for i, key in enumerate(keys)} for gid, keys in acquisition.wanted.items()}

        def views(pages: Mapping[int, Sequence[bytes]]):
            for gid, keys in pages.items():
                region, pool = self.regions[gid], self.pools.pool(gid)
                at = [position[gid][k] for k in keys]
                slots = [pool.slot_of(k) for k in keys]
                start = 0
                for end in range(1, len(keys) + 1):
                    if end == len(keys) or slots[end] != slots[end - 1] + 1 or at[end] != at[end - 1] + 1:
                        yield gid, at[start:end], region.pages(slots[start], end - start)
                        start = end

        pending: dict[Future, list[tuple[int, bytes, Future]]] = {}   # batch read -> its pages
        for promotion, pages in list(acquisition.waiting.items()):
            waited = {(gid, key) for gid, keys in pages.items() for key in keys}
            for gid, key, _, future in promotion.jobs:
                if (gid, key) in waited:
                    pending.setdefault(getattr(future, "batch", future), []).append((gid, key, future))
        yield from views({gid: list(keys) for gid, keys in acquisition.pinned.items()})
        while pending:
            for batch in wait(pending, return_when=FIRST_COMPLETED).done:
                landed: dict[int, list[bytes]] = {}
                pages = pending.pop(batch)
                for (gid, key, _), (success, _) in zip(pages, outcomes([f for *_, f in pages]), strict=True):
                    if success:
                        landed.setdefault(gid, []).append(key)
                yield from views(landed)

    def release_acquisition(self, acquisition: Acquisition) -> None:
        """Unpin what the acquisition holds and stop waiting for the rest (finished,
        aborted or failed, in any state)."""
        for promotion in acquisition.waiting:
            promotion.waiters = [a for a in promotion.waiters if a is not acquisition]
        acquisition.waiting = {}
        self.pools.complete_load(acquisition.pinned, acquisition.request)
        acquisition.pinned = {}

    def release(self, wanted: Mapping[int, Sequence[bytes]], request: str | None = None) -> None:
        self.pools.complete_load(wanted, request)

    def prefetch(self, group: int, keys: Sequence[bytes], where: Sequence[str | None]) -> int:
        """Start reading into RAM the pages ``where`` puts in a secondary tier and RAM lacks,
        pinning nothing; returns how many. A load that wants them later waits for these
        reads instead of starting its own, and ``poll`` publishes pages nobody waited for.
        For a caller still keying the rest of a prompt: its first pages are on their way."""
        pool = self.pools.pool(group)
        missing = [key for key, tier in zip(keys, where, strict=True)
                   if tier is not None and tier != RAM and pool.lookup(key) is Lookup.MISS]
        sources = {(group, key): tier for key, tier in zip(keys, where, strict=True)}
        if not missing or self._start_promotion({group: missing}, sources, drain=False) is None:
            return 0            # no room now: the load makes room (it may wait for writes)
        return len(missing)

    def _start_promotion(self, missing: Mapping[int, Sequence[bytes]],
                         sources: dict[tuple[int, bytes], str | None], drain: bool = True) -> Promotion | None:
        """Reserve RAM slots for pages only secondary tiers hold and start reading each from
        the tier ``sources`` names, or else the first tier holding it. Short of room,
        ``drain`` waits for the write-throughs that pin slots and tries again."""
        for gid, keys in missing.items():
            unknown = [key for key in keys if sources[(gid, key)] is None]
            for key, tier in zip(unknown, self.locate_below_ram(gid, unknown), strict=True):
                if tier is None:
                    return None
                sources[(gid, key)] = tier
        plans = self.pools.prepare_store(missing)
        if plans is None and drain and self._writes:
            # Slots pinned only by write-through free up once those writes land: waiting for
            # them is bounded and far cheaper than recomputing the prefix.
            self.drain()
            plans = self.pools.prepare_store(missing)
        if plans is None:
            return None
        by_tier: dict[str, list] = {}
        for gid, plan in plans.items():
            for key, slot in zip(plan.keys, plan.slots, strict=True):
                by_tier.setdefault(sources[(gid, key)], []).append((gid, key, self.regions[gid].page(slot)))
        jobs = []
        for tier in self.secondaries:
            items = by_tier.get(tier.name, [])
            for (gid, key, _), future in zip(items, tier.submit_reads(items), strict=True):
                jobs.append((gid, key, tier, future))
        promotion = Promotion(jobs)
        for gid, key, _, _ in jobs:
            self._promotions[(gid, key)] = promotion
        return promotion

    def _settle(self, promotion: Promotion) -> None:
        """Wait for a promotion's reads, publish the pages that arrived, pin them for every
        acquisition waiting on them and mark those missing a page as failed."""
        if promotion.settled:
            return
        promotion.settled = True
        outcome: dict[bool, dict[int, list[bytes]]] = {True: {}, False: {}}
        lost = set()
        errors = []
        for (gid, key, tier, _), (success, error) in zip(
                promotion.jobs, outcomes([future for *_, future in promotion.jobs]), strict=True):
            if error is not None:
                errors.append(error)
            outcome[success].setdefault(gid, []).append(key)
            del self._promotions[(gid, key)]
            if success:
                counters = self.counters[tier.name]
                counters.hits += 1
                counters.bytes_out += self.layout.group(gid).page_bytes
            else:
                lost.add((gid, key))
        if errors:
            log.warning("%d reads into RAM raised (first: %r); those pages are misses", len(errors), errors[0])
        for success, keys in outcome.items():
            self.pools.complete_store(keys, success)
        for acquisition in promotion.waiters:
            arrived = {}
            for gid, keys in acquisition.waiting.pop(promotion).items():
                arrived[gid] = [k for k in keys if (gid, k) not in lost]
                acquisition.failed |= len(arrived[gid]) < len(keys)
            self.pools.prepare_load(arrived, acquisition.request)
            for gid, keys in arrived.items():
                acquisition.pinned.setdefault(gid, []).extend(keys)
        promotion.waiters = []

    # -- stores -----------------------------------------------------------------------------
    def store(self, pages: Mapping[int, Sequence[tuple[bytes, np.ndarray]]]) -> bool:
        """Copy new pages into RAM atomically across groups; False = retry later.

        Keys already present or in flight are skipped. Completed pages are written through
        to every secondary tier in the background.
        """
        plans = self.reserve({gid: [k for k, _ in items] for gid, items in pages.items() if items})
        if plans is None:
            return False
        for gid, plan in plans.items():
            data = dict(pages[gid])
            region = self.regions[gid]
            for key, slot in zip(plan.keys, plan.slots, strict=True):
                region.write(slot, data[key])
        self.commit(plans)
        return True

    def reserve(self, keys: Mapping[int, Sequence[bytes]]) -> dict[int, StorePlan] | None:
        """Claim RAM slots for the absent keys, atomically across groups (None = retry later).

        For engines that fill the slots themselves (a worker process writing into the shared
        region); every reservation must end in ``commit``.
        """
        keys = {gid: list(ks) for gid, ks in keys.items() if ks}
        if not keys:
            return {}
        plans = self.pools.prepare_store(keys)
        if plans is None and self._writes:
            for tier in self.secondaries:   # RAM is short: held write-through keeps slots pinned
                tier.flush()
        return plans

    def commit(self, plans: Mapping[int, StorePlan], ok: bool = True) -> None:
        """The reserved slots are filled (ok) or abandoned; filled pages are written through."""
        done = {gid: plan.keys for gid, plan in plans.items() if plan.keys}
        if not ok:
            self.pools.complete_store(done, False)
            return
        ram = self.counters[RAM]
        for gid, keys in done.items():
            ram.bytes_in += len(keys) * self.regions[gid].page_bytes
        self.pools.complete_store(done)
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

    def slot(self, group: int, key: bytes) -> int:
        """RAM slot of a resident page (pinned by ``acquire``), for engines that copy it."""
        return self.pools.pool(group).slot_of(key)

    def poll(self) -> int:
        """End-of-step: publish promotions whose reads finished (their pages are pinned for
        whoever waits), unpin pages whose write-through finished; returns how many of those."""
        for promotion in set(self._promotions.values()):    # one entry per page: ask each once
            if promotion.done():
                self._settle(promotion)
        done, waiting = [], []
        for w in self._writes:
            (done if all(f.done() for f in w.futures) else waiting).append(w)
        self._writes = waiting
        for w in done:
            self.pools.complete_load({w.group: [w.key]})
        return len(done)

    def drain(self) -> None:
        """Wait for every promotion and write-through (clean shutdown, or before another
        process reads). It runs inside engines' lookups when RAM is short, so a write job
        that failed is logged, never raised: the page is only not stored below RAM."""
        for promotion in set(self._promotions.values()):
            self._settle(promotion)
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
        groups = {}
        for gid, s in self.pools.stats().items():
            groups[gid] = {"kind": self.layout.group(gid).kind, **s}
        tiers = {name: vars(c).copy() for name, c in self.counters.items()}
        for tier in self.secondaries:
            tiers[tier.name].update(tier.stats)
        return {"groups": groups, "tiers": tiers, "pending_writes": len(self._writes),
                "promotions_in_flight": len(set(self._promotions.values()))}

    def close(self) -> None:
        try:
            if self.regions:
                self.drain()
        finally:
            for tier in self.secondaries:
                tier.close()
            for region in self.regions.values():
                region.close()
            self.regions = {}
            self.secondaries = []

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
