"""Request-level cache logic, engine-neutral: keys, the hybrid hit, loads and stores.

The engine asks how deep a prompt can be restored (``begin``/``load``) and which computed
blocks and boundary states the cache wants (``wants_block``/``wants_state``), then hands over
the pages it actually computed (``offer_block``/``offer_state``). Nothing is stored by
guessing positions. Offers that RAM refuses now stay pending and are retried each step.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import numpy as np

from hybridkv.cache import PageCache, store_pages
from hybridkv.core.errors import HybridKVError
from hybridkv.core.insertion import Insertion, Ticket
from hybridkv.core.keys import block_hashes
from hybridkv.core.layout import GroupKind, Layout
from hybridkv.core.periodic import PeriodicChoice
from hybridkv.core.retention import (
    AUTO,
    DivergenceAlignment,
    Hit,
    Retention,
    compute_hit,
    replay_boundary,
)
from hybridkv.core.shadow import ShadowCache, SharedShadowCache
from hybridkv.promotion import Load

log = logging.getLogger(__name__)
Pages = Mapping[int, np.ndarray]      # group id -> one page (uint8)
PageSink = Callable[[int, list[int], np.ndarray], None]    # group, adjacent blocks, their pages (a row each)


class PageKind(str, Enum):
    """What an offered page holds; the value names it in request stats."""
    ATTENTION = "attention"     # a full prompt block of a token group
    STATE = "state"             # the recurrent state at a boundary


class Offer(NamedTuple):
    """One pending offer: a block index for attention, a token boundary for a state."""
    kind: PageKind
    position: int


@dataclass
class RequestState:
    request_id: str
    n_tokens: int
    keys: list[bytes]
    hit: Hit = Hit(0, 0, None)
    sources: dict[str, int] = field(default_factory=dict)     # tier name -> pages loaded from it
    token_sources: dict[str, int] = field(default_factory=dict)   # tier name -> hit tokens it served
    stored: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in PageKind})
    pending: dict[Offer, dict] = field(default_factory=dict)
    max_stored_tokens: int | None = None
    spare_boundaries: list[int] = field(default_factory=list)   # asked about as spare: what the shadows replay
    local_blocks: int = 0      # leading blocks the engine already holds itself
    loaded: Load | None = None     # the hit's pages, pinned (or some still promoting)
    where: dict[int, list[str | None]] = field(default_factory=dict)   # tier per (group, block)
    retention: Retention | None = None     # the connector's when the request began (set by begin), for all its stores
    keyed_with: tuple = (None, b"")    # the salt and key tail (extra, epoch) the keys were made with
    ticket: Ticket = Ticket(False)     # whether its stores enter RAM cold, and what the shadows restored
    periodic: tuple = (None, (0, 0))   # the PeriodicChoice at begin, and what its shadows restored

    @property
    def hit_tokens(self) -> int:
        return self.hit.tokens

    @property
    def junction(self) -> int | None:
        return self.hit.junction


class StateLookup:
    """States exist only at the boundaries some request kept, and the hit rule walks down from
    its candidate until it finds one, so the slower tiers are asked about a state key only
    when RAM lacks it and the rule reaches it: in batches ending at the asked block, doubling
    (one round trip for the usual deepest-state hit, a logarithmic number for a miss)."""

    FIRST_BATCH = 4

    def __init__(self, cache: PageCache, gid: int, keys: list[bytes], where: list[str | None], reach: int):
        self.cache, self.gid, self.keys, self.where = cache, gid, keys, where
        self.asked = [w is not None for w in where]      # RAM already answered these
        self.reach = reach            # no hit goes deeper: nothing past it was looked up
        self.batch = self.FIRST_BATCH

    def present(self, block: int) -> bool:
        if block >= self.reach:
            return False
        if not self.asked[block]:
            lo = max(0, block - self.batch + 1)
            todo = [b for b in range(lo, block + 1) if not self.asked[b]]
            for b, tier in zip(todo, self.cache.lookup(self.gid, [self.keys[b] for b in todo], ram=False),
                               strict=True):
                self.where[b], self.asked[b] = tier, True
            self.batch *= 2
        return self.where[block] is not None


class RecentIds:
    """The last ``size`` request ids seen: a request an engine looks up or finishes again
    (vLLM: waiting, preempted) teaches a learner once."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()

    def first_sight(self, request_id: str) -> bool:
        if request_id in self._ids:
            return False
        self._ids[request_id] = None
        if len(self._ids) > self.size:
            self._ids.popitem(last=False)
        return True


class ReferenceLearner:
    """The traffic's mean prompt length, for a cache whose pools were sized without one
    (``reference_tokens`` unset: for the model's longest prompts, which leaves the state pools
    far too small where prompts are shorter). After ``FIRST`` requests, then twice as many each
    time up to every ``EVERY``, it compares the mean so far with what the pools are planned
    for; more than ``FACTOR`` apart either way, it wants a re-plan for the mean until told it
    happened (a re-plan of a static split empties RAM, so early and rarely). A request counts
    once, however often an engine looks it up or finishes it (vLLM: waiting, preempted)."""

    FIRST = 32
    EVERY = 256
    FACTOR = 1.5

    def __init__(self, block_tokens: int):
        self.B = block_tokens
        self.prompts = self.tokens = 0
        self.next_look = self.FIRST
        self.wanted: int | None = None
        self._seen = RecentIds()

    def observe(self, request_id: str, n_tokens: int, planned: int) -> int | None:
        """Count a finished request; the length RAM should be re-planned for, if any."""
        if self._seen.first_sight(request_id):
            self.prompts += 1
            self.tokens += n_tokens
        if self.wanted is None and self.prompts >= self.next_look:
            mean = max(self.B, self.tokens // self.prompts // self.B * self.B)
            if max(mean / planned, planned / mean) > self.FACTOR:
                self.wanted = mean
            else:
                self.replanned()
        return self.wanted

    def replanned(self) -> None:
        """Looked (and re-planned where it had to): the next look is later."""
        self.wanted = None
        self.next_look = self.prompts + min(self.prompts, self.EVERY)


class Connector:
    MAX_LOAD_ATTEMPTS = 3

    def __init__(self, cache: PageCache, retention: Retention | None = None):
        self.cache = cache
        self.layout: Layout = cache.layout
        self.B = self.layout.block_tokens
        config = cache.config
        self.retention = retention or Retention(self.B, config.retention_tokens(self.B), config.tail_states)
        self._tail = self.retention.tail
        self.spare_states = config.spare_states
        # state_align: auto learns where prompts diverge (see DivergenceAlignment), unless the
        # caller chose the retention itself
        self.alignment = (DivergenceAlignment(self.B) if config.state_align is None and retention is None
                          and not self.retention.dense else None)
        self._observed = RecentIds()       # request ids the alignment learned from
        self.groups = self.layout.cacheable_groups
        # attention groups first: no hit reaches past the first block one of them lacks
        self._lookup_order = sorted(self.groups, key=lambda g: g.kind is not GroupKind.ATTENTION)
        self.token_groups = [g.id for g in self.groups if g.is_token_group]
        self.state_groups = [g.id for g in self.groups if g.kind is GroupKind.STATE]
        self.stats = {"requests": 0, "hit_tokens": 0, "prompt_tokens": 0, "offers_retried": 0,
                      "offers_dropped": 0, "pages_stored": 0, "offers_pending": 0,
                      "state_align_tokens": self.B, "replans": 0, "cold_requests": 0, "spare_states": 0,
                      "reference_tokens": cache.plan.reference_tokens}
        # reference_tokens unset: learn the prompt length the split between KV and states needs
        self.reference = (ReferenceLearner(self.B) if config.reference_tokens is None and self.state_groups
                          else None)
        if config.state_align and retention is None:
            self._realign(config.state_align)
        self._epoch = b""          # enters every key; a new one when the weights change
        # retention = auto: whether its periodic states pay for their bytes is learned
        self._periodic_interval = (self.retention.interval if config.retention == AUTO and retention is None
                                   and self.state_groups and config.eviction == "lru" else None)
        self.insertion, self.periodic = self._new_insertion(), self._new_periodic()
        self._retention_now()

    def _new_insertion(self, score: float = 0.0) -> Insertion:
        """Where stores enter RAM's eviction order, its shadows as large as the pools now. The
        shadows replay LRU: under another eviction policy ``adaptive`` stores warm."""
        config = self.cache.config
        mode = "warm" if config.insertion == "adaptive" and config.eviction != "lru" else config.insertion
        insertion = Insertion(mode, self.B, *self._shadow_slots(), score)
        self.stats["insertion_cold"] = int(insertion.prefers_cold)
        return insertion

    def _shadow_slots(self) -> tuple[int, int | None]:
        """A statically split shadow's sizes: the plan's block slots, and the fewest slots of a
        state group (None: no state groups)."""
        plan = self.cache.plan
        state_slots = [g.slots for g in plan.groups if g.id in self.state_groups]
        return plan.token_slots, min(state_slots) if state_slots else None

    def _new_periodic(self, score: float = 0.0) -> PeriodicChoice | None:
        """The choice of periodic states, its shadows as large as RAM now and shaped like it
        (one budget over an arena, slots per kind over a static split)."""
        if self._periodic_interval is None:
            return None
        shared = self.cache.shared_ram_bytes
        if shared is None:
            shadows = (ShadowCache(*self._shadow_slots()), ShadowCache(*self._shadow_slots()))
        else:
            sizes = self.layout.block_bytes, self.layout.state_bytes
            shadows = (SharedShadowCache(shared, *sizes), SharedShadowCache(shared, *sizes))
        return PeriodicChoice(self.B, self._periodic_interval, shadows, score)

    def _retention_now(self) -> Retention:
        """The retention a request begun now stores under; with ``retention = auto``, with or
        without its periodic states as the choice has it now."""
        if self.periodic is not None and self.retention.interval != self.periodic.interval_now:
            self.retention = dataclasses.replace(self.retention, interval=self.periodic.interval_now)
            log.info("periodic states %s: lately RAM restored more %s them", "resumed" if
                     self.periodic.keeps_periodic else "paused", "with" if self.periodic.keeps_periodic else "without")
        if self.state_groups:
            self.stats["periodic_states"] = int(bool(self.retention.interval))
        return self.retention

    def _renew_learners(self) -> None:
        """RAM was emptied (a reset, or a static split re-planned): new shadows as large as it
        is now, the scores kept (the traffic did not change)."""
        self.insertion = self._new_insertion(self.insertion.score)
        self.periodic = self._new_periodic(self.periodic.score if self.periodic else 0.0)

    # -- lookup and load --------------------------------------------------------------------
    def begin(self, request_id: str, tokens: Sequence[int], salt: str | None = None,
              max_stored_tokens: int | None = None, extra: bytes | None = None,
              local_tokens: int = 0, prefetch: bool = False, again: RequestState | None = None) -> RequestState:
        """Key the prompt and find its hybrid hit over every tier (one call to compute_hit).

        ``extra`` (adapter id, multimodal hashes) enters every key; ``local_tokens`` is the
        prefix the engine's own cache already holds: its token pages count as present and
        are not loaded again. ``prefetch`` is for an engine that loads right after: the
        reads of the prompt's first pages below RAM start while the rest is keyed (at 32K
        tokens they started ~3.5 ms sooner; see ``_key_and_prefetch``). ``again`` is this
        request's state from a lookup of the same tokens (an engine asks again for a request
        it could not schedule yet): its keys are reused where they were made with the same
        salt and extra and no reset came since; the hit is found afresh.
        """
        tail = (extra or b"") + self._epoch
        req = RequestState(request_id, len(tokens), [], sources=dict.fromkeys(self.cache.tier_names, 0),
                           max_stored_tokens=max_stored_tokens, local_blocks=local_tokens // self.B,
                           keyed_with=(salt, tail))
        self.cache.request_started(request_id)
        located = None
        if again is not None and self._keys_hold(again, salt, extra) and again.n_tokens == len(tokens):
            req.keys = again.keys         # (nothing to prefetch ahead of keying then)
        elif prefetch:
            located = self._key_and_prefetch(req, tokens, salt, tail)
        else:
            req.keys = block_hashes(tokens, self.B, salt, tail)
        req.hit = self._find_hit(req, located)
        self._learn_alignment(req)
        req.retention = self._retention_now()
        req.ticket = self.insertion.begin(req.keys, req.n_tokens, req.hit.tokens)
        if self.periodic is not None:
            req.periodic = (self.periodic, self.periodic.begin(req.keys, req.n_tokens))
        self.stats["cold_requests"] += req.ticket.cold
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += req.n_tokens
        return req

    def look_again(self, req: RequestState, salt: str | None = None, extra: bytes | None = None) -> bool:
        """An engine asks again about a request it has not scheduled yet, nothing pinned for
        it: find its hit afresh (pages stored since count) over the keys it has, under the
        retention now in force (as ``begin`` would). False where the keys no longer hold
        (another salt or extra, or a reset since): ``begin`` it anew."""
        if not self._keys_hold(req, salt, extra):
            return False
        req.hit = self._find_hit(req)
        req.retention = self._retention_now()
        return True

    def _keys_hold(self, req: RequestState, salt: str | None, extra: bytes | None) -> bool:
        return req.keyed_with == (salt, (extra or b"") + self._epoch)

    def _learn_alignment(self, req: RequestState) -> None:
        if self.alignment is None or not self._observed.first_sight(req.request_id):
            return
        if self.alignment.observe(req.hit.attention_tokens, replay_boundary(req.n_tokens, self.B)):
            self._realign(self.alignment.align)

    def _realign(self, align: int) -> None:
        """Keep each prompt's state at the learned alignment. Past one block it replaces the
        tail states: the aligned boundary is the one of them a follow-up can share."""
        aligned = align > self.B
        self.retention = dataclasses.replace(self.retention, align=align if aligned else 0,
                                             tail=0 if aligned else self._tail)
        self.stats["state_align_tokens"] = align
        log.info("each prompt's state is kept at the deepest multiple of %d tokens%s",
                 align, ", without tail states" if aligned else "")

    PREFETCH_FIRST_BLOCKS = 16      # the first part keyed and looked up while prefetching

    def _key_and_prefetch(self, req: RequestState, tokens: Sequence[int], salt, tail: bytes) -> dict[int, list]:
        """Key the prompt a part at a time (16 blocks, then twice as many each time) and look
        each part up in the token groups at once, starting the reads of its pages that lie
        below RAM while the next part is keyed. Nothing past the first block a token group
        lacks is read: the hit ends before it. Returns the token groups' tier per block,
        for ``_find_hit``."""
        cap = max(0, (req.n_tokens - 1) // self.B)
        local = min(req.local_blocks, cap)
        n_blocks, part = len(tokens) // self.B, self.PREFETCH_FIRST_BLOCKS
        where = {gid: [None] * local for gid in self.token_groups}
        stored = cap           # blocks every token group holds, as far as looked up
        while len(req.keys) < n_blocks:
            first = len(req.keys)
            last = min(n_blocks, first + part)
            req.keys += block_hashes(tokens[first * self.B:last * self.B], self.B, salt, tail,
                                     after=req.keys[-1] if req.keys else None)
            lo, hi = max(first, local), min(last, cap)
            if lo < hi:
                found = {gid: self.cache.lookup(gid, req.keys[lo:hi]) for gid in self.token_groups}
                for tiers in found.values():
                    if None in tiers:
                        stored = min(stored, lo + tiers.index(None))
                reading = 0
                for gid, tiers in found.items():
                    where[gid] += tiers
                    reading += self.cache.prefetch(gid, req.keys[lo:stored], tiers[:max(0, stored - lo)])
                if reading:     # hand the GIL to the reader threads: they start their reads now
                    time.sleep(0)
            part *= 2
        return where

    def _find_hit(self, req: RequestState, located: dict[int, list] | None = None) -> Hit:
        """Attention groups are looked up first: no hit reaches past the first block one of
        them lacks, so the other groups are looked up only that far (a miss looks up no
        state at all; on unique prompts those lookups were half of a miss's)."""
        cap = max(0, (req.n_tokens - 1) // self.B)
        local = min(req.local_blocks, cap)
        where, lazy = {}, {}
        reach = cap
        for g in self._lookup_order:
            skip = local if g.is_token_group else 0   # token pages the engine holds are not looked up
            state = g.kind is GroupKind.STATE
            if located and g.id in located:     # token groups ``begin`` looked up already
                where[g.id] = located[g.id]
            else:
                upto = cap if g.kind is GroupKind.ATTENTION else max(reach, skip)
                found = self.cache.lookup(g.id, req.keys[skip:upto], below_ram=not state,
                                          prefix=g.kind is GroupKind.ATTENTION)
                where[g.id] = [None] * skip + found + [None] * (cap - upto)
            if g.kind is GroupKind.ATTENTION and None in where[g.id][local:reach]:
                reach = where[g.id].index(None, local)
            if state:
                lazy[g.id] = StateLookup(self.cache, g.id, req.keys, where[g.id], reach)
        req.where = where
        token_groups = set(self.token_groups)

        def present(gid: int, block: int) -> bool:
            if gid in lazy:
                return lazy[gid].present(block)
            return where[gid][block] is not None or (block < local and gid in token_groups)

        return compute_hit(self.groups, req.n_tokens, self.B, present)

    def forget_all(self) -> int:
        """Serve none of the pages stored so far: the engine's weights changed (an RL weight
        update; vLLM's ``reset_prefix_cache(reset_connector=True)``). Keys take a fresh random
        epoch, so no stored page matches again in this process; RAM frees the pages no request
        is using (returns how many). Disk and Redis pages age out under their quotas: a restart
        on the original weights finds the pages made with them, which are valid there."""
        self._epoch = secrets.token_bytes(16)
        self._renew_learners()
        return self.cache.forget_ram()

    def hit_blocks(self, req: RequestState) -> dict[int, range]:
        """Blocks the hit loads: token groups every block the engine does not hold, state
        groups the last one's state."""
        n = req.hit.tokens // self.B
        blocks = {gid: range(min(req.local_blocks, n), n) for gid in self.token_groups}
        blocks.update({gid: range(n - 1, n) for gid in self.state_groups})
        return blocks

    def load(self, req: RequestState, on_pages: PageSink | None = None) -> dict[int, list[np.ndarray]] | None:
        """Pin the hit's pages in RAM and return views: token groups get every block up to
        the hit, state groups the one state at the hit. Waits for pages promoted from slower
        tiers; shrinks the hit if a page vanished or did not read back.

        ``on_pages(group, blocks, pages)`` sees the pages as they reach RAM, a run of
        adjacent blocks at a time (ascending; ``pages`` has a row each), so an engine copies
        them while later ones are still being read. Pages of a failed attempt may
        have been seen; every page of the hit that ``load`` returns is seen (again) in its
        last attempt, and a shorter hit is the same keys, hence the same bytes."""
        for _ in range(self.MAX_LOAD_ATTEMPTS):
            acquisition = self.start_load(req)
            if acquisition is None:
                return None
            if on_pages is not None:
                blocks = self.hit_blocks(req)
                for gid, positions, pages in self.cache.arrivals(acquisition):
                    on_pages(gid, [blocks[gid][p] for p in positions], pages)
            views = self.finish_load(req)
            if views is not None:
                return views
            req.hit = self._find_hit(req)     # a read failed (evicted, corrupt): look again
        req.hit = Hit(0, req.hit.attention_tokens, req.hit.junction)
        return None

    def start_load(self, req: RequestState) -> Load | None:
        """``load`` without the wait: pins what RAM holds and starts reading the rest, then
        returns (``Load.ready`` says when ``finish_load`` will not block). Shrinks
        the hit if a page vanished before its read started; None when nothing is left."""
        for _ in range(self.MAX_LOAD_ATTEMPTS):
            if req.hit.tokens == 0:
                return None
            blocks = self.hit_blocks(req)
            wanted = {gid: [req.keys[b] for b in bs] for gid, bs in blocks.items()}
            where = {gid: [req.where[gid][b] for b in bs] for gid, bs in blocks.items()}
            req.loaded = self.cache.prepare_load(wanted, req.request_id, where)
            if req.loaded is not None:
                req.sources, req.token_sources = self._sources(req, blocks)
                return req.loaded
            req.hit = self._find_hit(req)     # a page was lost (evicted, corrupt): look again
        req.hit = Hit(0, req.hit.attention_tokens, req.hit.junction)
        return None

    def finish_load(self, req: RequestState) -> dict[int, list[np.ndarray]] | None:
        """Views of the started load's pages once all are in RAM; None (nothing pinned any
        more) when a page did not read back: the engine recomputes instead."""
        views = self.cache.complete_load(req.loaded)
        if views is None:
            req.loaded = None
        return views

    def _sources(self, req: RequestState, blocks: dict[int, range]) -> tuple[dict[str, int], dict[str, int]]:
        """Pages loaded from each tier, and the loaded tokens by tier: a block's tokens count
        for the slowest tier any of its pages came from; blocks without pages of their own (a
        state-only model's) count with the hit's last block, whose state restores them.
        Counted a group at a time (this runs beside the reads it just started)."""
        names = self.cache.tier_names
        rank = {name: i for i, name in enumerate(names)}
        pages = dict.fromkeys(names, 0)
        n = req.hit.tokens // self.B
        slowest = [-1] * n                     # per block: the slowest tier's rank, -1: no page
        for gid, bs in blocks.items():
            tiers = req.where[gid][bs.start:bs.stop]
            for tier, count in Counter(tiers).items():
                pages[tier] += count
            slowest[bs.start:bs.stop] = map(max, slowest[bs.start:bs.stop], map(rank.__getitem__, tiers))
        tokens = dict.fromkeys(names, 0)
        for r, count in Counter(slowest[min(req.local_blocks, n):]).items():
            tokens[names[r if r >= 0 else slowest[n - 1]]] += count * self.B
        return pages, tokens

    def release(self, req: RequestState) -> None:
        """Unpin loaded pages and refresh recency so the prefix outlives its tail."""
        if req.loaded is None:
            return
        self.cache.release(req.loaded)
        self.cache.touch(req.loaded.wanted)
        self.stats["hit_tokens"] += req.hit.tokens
        req.loaded = None

    # -- stores -----------------------------------------------------------------------------
    def wants_state(self, req: RequestState, boundary: int) -> bool:
        """Must the engine snapshot the recurrent state at this boundary? Yes where the
        retention keeps it, and for any other servable boundary while RAM has room for a state
        without evicting a page (a spare state, see ``is_spare``)."""
        if not self.state_groups or self._over_cap(req, boundary):
            return False
        if req.retention.keeps(boundary, req.n_tokens, req.hit.junction):
            return True
        if not self.spare_states or not req.retention.servable(boundary, req.n_tokens):
            return False
        req.spare_boundaries.append(boundary)     # the engine has a state here, room or not
        return self._spare_room()

    def is_spare(self, req: RequestState, kind: PageKind, position: int) -> bool:
        """A state the retention does not keep: stored only into free RAM room, cold, and in
        RAM only until a hit uses it (``prepare_store(spare=True)``). Until RAM fills, such states serve what a denser
        retention would (a second request branching where no kept state is); they never
        evict a page, so where RAM is full they are not stored."""
        return (self.spare_states and kind is PageKind.STATE
                and not req.retention.keeps(position, req.n_tokens, req.hit.junction))

    def _spare_room(self) -> bool:
        return all(self.cache.free_slots(gid) > 0 for gid in self.state_groups)

    def wants_block(self, req: RequestState, block: int) -> bool:
        """Should the engine hand over the attention pages of this full prompt block?"""
        return block < len(req.keys) and not self._over_cap(req, (block + 1) * self.B)

    def _over_cap(self, req: RequestState, tokens: int) -> bool:
        return req.max_stored_tokens is not None and tokens > req.max_stored_tokens

    def offer_block(self, req: RequestState, block: int, pages: Pages) -> None:
        """Attention/sliding-window pages of one full prompt block the engine computed."""
        key = req.keys[block]
        self._offer(req, Offer(PageKind.ATTENTION, block), {gid: [(key, page)] for gid, page in pages.items()})

    def offer_state(self, req: RequestState, boundary: int, pages: Pages) -> None:
        """The exact recurrent state at ``boundary`` (a multiple of B) the engine materialized."""
        key = req.keys[boundary // self.B - 1]
        self._offer(req, Offer(PageKind.STATE, boundary), {gid: [(key, page)] for gid, page in pages.items()})

    def _offer(self, req: RequestState, offer: Offer, pages: dict) -> None:
        if offer not in req.pending:        # a re-offer supersedes the older one
            self.stats["offers_pending"] += 1
        req.pending[offer] = pages
        self._try_store(req, offer)

    def _try_store(self, req: RequestState, offer: Offer) -> bool:
        """Store a pending offer; a spare one that finds no free room is dropped, not retried."""
        pages = req.pending[offer]
        spare = self.is_spare(req, offer.kind, offer.position)
        stored = store_pages(self.cache, pages, req.ticket.cold, spare)
        if not stored and not spare:
            return False
        del req.pending[offer]
        self.stats["offers_pending"] -= 1
        if not stored:
            return False
        req.stored[offer.kind.value] += sum(len(v) for v in pages.values())
        self.stats["pages_stored"] += sum(len(v) for v in pages.values())
        self.stats["spare_states"] += spare
        return True

    def step(self, req: RequestState) -> None:
        """End of an engine step: retry pending offers, finish background writes."""
        for offer in list(req.pending):
            self.stats["offers_retried"] += 1
            self._try_store(req, offer)
        self.cache.poll()

    def finish(self, req: RequestState, done: bool = True) -> None:
        """Request done or preempted: pending offers lose their source and are dropped. Not
        ``done``: the engine will ask about it again (it is begun afresh), so the insertion
        does not learn from it yet."""
        self.step(req)
        if req.pending:
            log.warning("request %s finished with %d page offers RAM could not take; dropped",
                        req.request_id, len(req.pending))
            self.stats["offers_dropped"] += len(req.pending)
            self.stats["offers_pending"] -= len(req.pending)
            req.pending.clear()
        self.release(req)
        self.cache.request_finished(req.request_id)
        if done and req.retention is not None:
            self.insertion.finished(req.keys, req.n_tokens, req.ticket, req.retention, req.hit.junction,
                                    req.max_stored_tokens, req.spare_boundaries)
            self.stats["insertion_cold"] = int(self.insertion.prefers_cold)
            self._learn_periodic(req)
        if self.reference is not None:
            self._learn_reference(req)

    def _learn_periodic(self, req: RequestState) -> None:
        choice, hits = req.periodic
        if choice is None or choice is not self.periodic:     # begun before RAM was emptied
            return
        choice.finished(req.keys, req.n_tokens, hits, req.retention, req.hit.junction, req.ticket.cold,
                        req.max_stored_tokens, req.spare_boundaries if self.spare_states else None)

    def _learn_reference(self, req: RequestState) -> None:
        """Re-plan the RAM pools for the traffic's mean prompt once it is known and far from the
        planned one. Split statically, the cache swaps them at a moment no RAM page is in use
        and RAM is emptied; sharing one budget, RAM keeps its pages and only the shadows the
        plan sizes change."""
        want = self.reference.observe(req.request_id, req.n_tokens, self.cache.plan.reference_tokens)
        if want is None:
            return
        try:
            if not self.cache.replan(want):
                return                      # not yet: asked again at the next finished request
        except HybridKVError as e:
            log.warning("RAM stays split for %d-token prompts (%s); set reference_tokens to the mean prompt",
                        self.cache.plan.reference_tokens, e)
            self.reference = None
            return
        self.reference.replanned()
        kept = self.cache.shared_ram_bytes is not None
        if kept:
            self.insertion.resize(*self._shadow_slots())    # RAM kept its pages: the shadows keep theirs
        else:
            self._renew_learners()
        self.stats["replans"] += 1
        self.stats["reference_tokens"] = want
        log.info("RAM re-planned for %d-token prompts, the mean of the %d so far (reference_tokens is not set); %s",
                 want, self.reference.prompts, "its pages kept (its split follows the traffic)" if kept
                 else "the pages RAM held were dropped")
