"""Loads and the promotions under them: a request's pages pinned in RAM, the ones only a
slower tier holds read into RAM slots first.

A ``Promotion`` is one batch of reads into RAM slots reserved for them. Its life has two
states: in flight (the slots are write-pending, so nothing serves or evicts them, and a load
wanting one of its pages waits on it instead of reading the page again), then settled, once:
the pages that arrived are published and pinned for every load waiting on them, the others
are freed and their loads marked failed. ``Promotions`` holds the ones in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import numpy as np

from hybridkv.ram.grouped_pools import GroupedPools
from hybridkv.ram.pool import StorePlan
from hybridkv.tiers.base import SecondaryTier
from hybridkv.tiers.io_queue import batches_of, outcomes

log = logging.getLogger(__name__)


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0        # keys looked up in the tier and not found there
    bytes_in: int = 0      # bytes stored into the tier
    bytes_out: int = 0     # bytes served from the tier


class Promotion:
    """One batch of reads into reserved RAM slots, and the loads waiting on it."""

    def __init__(self, jobs: list[tuple[int, bytes, SecondaryTier, Future]]):
        self.jobs = jobs
        self.waiters: list[Load] = []
        self.settled = False
        self._batches = batches_of(future for *_, future in jobs)

    def done(self) -> bool:
        return self.settled or all(batch.done() for batch in self._batches)


@dataclass(eq=False)
class Load:
    """A request's wanted pages: those pinned for it, and those it waits for from promotions.
    ``slots`` are the RAM slots of ``wanted`` in its order (known at once: a promoted page's
    slot is reserved before its read starts), for engines that copy pages themselves."""

    wanted: dict[int, list[bytes]]
    request: str | None
    pinned: dict[int, list[bytes]]
    waiting: dict[Promotion, dict[int, list[bytes]]]
    slots: dict[int, list[int]] = field(default_factory=dict)
    failed: bool = False          # a page it waited for did not arrive

    def ready(self) -> bool:
        """Would ``TieredCache.complete_load`` return without waiting?"""
        return all(promotion.done() for promotion in self.waiting)


class Promotions:
    """The promotions in flight, one entry per page being read."""

    def __init__(self, pools: GroupedPools, regions: Mapping, counters: dict[str, TierCounters],
                 tiers: Sequence[SecondaryTier]):
        self.pools, self.regions, self.counters, self.tiers = pools, regions, counters, tiers
        self._by_page: dict[tuple[int, bytes], Promotion] = {}

    def of(self, group: int, key: bytes) -> Promotion | None:
        """The promotion reading this page, if one is."""
        return self._by_page.get((group, key))

    def in_flight(self) -> set[Promotion]:
        return set(self._by_page.values())

    def start(self, plans: Mapping[int, StorePlan], sources: Mapping[tuple[int, bytes], str]) -> Promotion:
        """Read each planned page from the tier ``sources`` names into its reserved slot."""
        by_tier: dict[str, list] = {}
        for gid, plan in plans.items():
            for key, slot in zip(plan.keys, plan.slots, strict=True):
                by_tier.setdefault(sources[(gid, key)], []).append((gid, key, self.regions[gid].page(slot)))
        jobs = []
        for tier in self.tiers:
            items = by_tier.get(tier.name, [])
            for (gid, key, _), future in zip(items, tier.submit_reads(items), strict=True):
                jobs.append((gid, key, tier, future))
        promotion = Promotion(jobs)
        for gid, key, _, _ in jobs:
            self._by_page[(gid, key)] = promotion
        return promotion

    def settle(self, promotion: Promotion) -> None:
        """Wait for a promotion's reads, publish the pages that arrived, pin them for every
        load waiting on them and mark those missing a page as failed."""
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
            del self._by_page[(gid, key)]
            if success:
                counters = self.counters[tier.name]
                counters.hits += 1
                counters.bytes_out += self.regions[gid].page_bytes
            else:
                lost.add((gid, key))
        if errors:
            log.warning("%d reads into RAM raised (first: %r); those pages are misses", len(errors), errors[0])
        for success, keys in outcome.items():
            self.pools.complete_store(keys, success)
        for load in promotion.waiters:
            arrived = {}
            for gid, keys in load.waiting.pop(promotion).items():
                arrived[gid] = [k for k in keys if (gid, k) not in lost]
                load.failed |= len(arrived[gid]) < len(keys)
            self.pools.prepare_load(arrived, load.request)
            for gid, keys in arrived.items():
                load.pinned.setdefault(gid, []).extend(keys)
        promotion.waiters = []

    def settle_finished(self) -> None:
        """Settle every promotion whose reads all finished (none waits)."""
        for promotion in self.in_flight():
            if promotion.done():
                self.settle(promotion)

    def settle_all(self) -> None:
        for promotion in self.in_flight():
            self.settle(promotion)

    def forget_request(self, request: str) -> None:
        """The request is gone: pin nothing for it when its promotions settle."""
        for promotion in self.in_flight():
            promotion.waiters = [load for load in promotion.waiters if load.request != request]

    def arrivals(self, load: Load) -> Iterator[tuple[int, list[int], np.ndarray]]:
        """The load's pages as they reach RAM: (group, positions in ``wanted[group]``, a view
        of their slots, one page a row), the pinned pages at once, then each batch of
        promoted pages as its read lands, so an engine copies pages while later ones are
        still being read. Each view covers adjacent slots holding adjacent positions, so an
        engine copies a run of pages in one call (one release of the GIL, not one a page:
        beside the I/O threads, a copy that released it per page ran 2x slower). A page
        whose read failed is not yielded; ``complete_load`` then fails the load. The views
        stay valid until the load is released."""
        position = {gid: {key: i for i, key in enumerate(keys)} for gid, keys in load.wanted.items()}

        def views(pages: Mapping[int, Sequence[bytes]]):
            for gid, keys in pages.items():
                region = self.regions[gid]
                at = [position[gid][k] for k in keys]
                slots = [load.slots[gid][i] for i in at]
                start = 0
                for end in range(1, len(keys) + 1):
                    if end == len(keys) or slots[end] != slots[end - 1] + 1 or at[end] != at[end - 1] + 1:
                        yield gid, at[start:end], region.pages(slots[start], end - start)
                        start = end

        pending: dict[Future, list[tuple[int, bytes, Future]]] = {}   # batch read -> its pages
        for promotion, pages in list(load.waiting.items()):
            waited = {(gid, key) for gid, keys in pages.items() for key in keys}
            for gid, key, _, future in promotion.jobs:
                if (gid, key) in waited:
                    pending.setdefault(getattr(future, "batch", future), []).append((gid, key, future))
        yield from views({gid: list(keys) for gid, keys in load.pinned.items()})
        while pending:
            for batch in wait(pending, return_when=FIRST_COMPLETED).done:
                landed: dict[int, list[bytes]] = {}
                pages = pending.pop(batch)
                for (gid, key, _), (success, _) in zip(pages, outcomes([f for *_, f in pages]), strict=True):
                    if success:
                        landed.setdefault(gid, []).append(key)
                yield from views(landed)
