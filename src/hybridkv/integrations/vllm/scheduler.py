"""The scheduler half: owns the TieredCache and decides every load and store.

It runs in vLLM's engine-core process. For each request it keys the prompt, finds the hybrid
hit over every tier and pins the hit's pages in RAM *before* reporting it (a reported hit is
always servable). It then tells the worker, per step, which RAM slots to copy into which vLLM
blocks (loads) and which freshly computed blocks and boundary states to copy out (stores into
slots it reserved). The worker's report completes the stores, which then go to disk/Redis.

Pages of a hit that only disk or Redis hold are read into RAM first (promotion). Waiting for
those reads inside vLLM's scheduler would stall every running request's next token, so when
vLLM recomputes a failed load (``kv_load_failure_policy: recompute``) the reads run in the
background: the request waits in vLLM's WAITING_FOR_REMOTE_KVS until they land, and a read
that fails then fails its load, which vLLM recomputes. Under vLLM's default policy (``fail``)
such a failure would end the request, so there the reads finish before the hit is reported
and a failed read only shortens the hit (``async_promotion`` overrides either way).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from hybridkv.cache import TieredCache
from hybridkv.connector import Connector, PageKind, RequestState
from hybridkv.core.errors import HybridKVError
from hybridkv.core.planner import unset_reference_warning
from hybridkv.integrations.vllm.layout import (
    async_promotion,
    cache_config_from_extra,
    check_vllm_version,
    layout_from_vllm,
    load_within_step,
)
from hybridkv.integrations.vllm.messages import (
    ENGINE_S_ALONE,
    Copy,
    RegionInfo,
    StepPlan,
    WorkerReport,
)
from hybridkv.integrations.vllm.request_identity import request_identity
from hybridkv.integrations.vllm.stats_file import StatsFile
from hybridkv.integrations.vllm.stopping import drain_before_stop

log = logging.getLogger(__name__)


@dataclass
class _Request:
    state: RequestState
    tokens: list[int]             # vLLM's prompt list, by identity (see _match)
    local_tokens: int
    pinned: bool = False          # the hit's pages are pinned until every worker loaded them
    within_step: bool = False     # loaded in the step that computes the rest of the prompt
    loaded_tokens: int = 0
    match_ms: float = 0.0         # how long vLLM's scheduler waited for the lookup


@dataclass
class _Acks:
    """Which TP ranks reported their slice of a copy, and whether every one succeeded."""

    ranks: set = field(default_factory=set)
    ok: bool = True

    def add(self, rank: int, ok: bool, tp_size: int) -> bool:
        """One rank's report; True once every rank has reported."""
        self.ranks.add(rank)
        self.ok &= ok
        return len(self.ranks) == tp_size


@dataclass
class _Reservation:
    request: str
    plans: dict
    kind: PageKind
    acks: _Acks = field(default_factory=_Acks)


@dataclass
class SchedulerStats:
    loads: int = 0
    load_failures: int = 0
    loaded_tokens: int = 0
    promotions_waited: int = 0    # loads that waited for disk/Redis reads in the background
    promotion_failures: int = 0   # of those, loads a read failed (vLLM recomputes them)
    match_ms_max: float = 0.0     # the longest lookup vLLM's scheduler waited for
    stores_refused: int = 0       # stores RAM refused (nothing evictable): a state, or a request's blocks of a step
    store_failures: int = 0       # reservations (a request's pages of a step) a worker failed to copy
    junctions_requested: int = 0
    loads_within_step: int = 0    # loads copied in the step that ran the request, not one before
    hits_trimmed: int = 0         # vLLM accepted another hit than the one pinned: recomputed
    engine_s: float = 0.0         # in the connector's scheduler hooks, all told
    worker_engine_s: float = 0.0  # in its worker hooks, summed over ranks (as far as reported)
    hook_s: Counter = field(default_factory=Counter)          # engine_s by hook
    worker_hook_s: Counter = field(default_factory=Counter)   # worker_engine_s by hook


class SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config, extra: dict):
        self.layout = layout_from_vllm(vllm_config, kv_cache_config)
        self.B = self.layout.block_tokens
        config = cache_config_from_extra(extra, self.B)
        if self.layout.revision is None and (config.store or config.remote):
            raise HybridKVError(
                f"hybridkv cannot tell which weights {self.layout.model} holds (no commit hash from "
                "the Hub): stored pages could be served to other weights. Pass --revision <commit>, "
                "serve a local checkpoint directory, or leave out store and remote (RAM only)")
        self.async_promotion = async_promotion(extra, vllm_config)     # refused before any region exists
        self.within_step = load_within_step(extra, kv_cache_config)
        self.cache = TieredCache(self.layout, config)
        shared = self.cache.shared_ram_bytes is not None
        if (warning := unset_reference_warning(self.layout, config.reference_tokens, shared)) is not None:
            log.warning("hybridkv: %s", warning)
        self.connector = Connector(self.cache)
        self.stats = SchedulerStats()
        self.stats_file = StatsFile(extra["stats_file"]) if extra.get("stats_file") else None
        self._requests: dict[str, _Request] = {}
        self._loads: dict[str, list[Copy]] = {}
        self._reservations: dict[int, _Reservation] = {}
        self._next_reservation = 0
        self._failed_loads: set[str] = set()   # their load failed: no hit again
        self._promoting: dict[str, list[Copy]] = {}   # allocated loads whose reads are in flight
        self._promotion_failed: set[str] = set()      # for the worker to report as failed loads
        self._abandoned: set[str] = set()             # finished while promoting: reported done
        self._load_acks: dict[str, _Acks] = {}        # loads some ranks have reported
        self._within: dict[str, list[Copy]] = {}      # allocated loads of this step's running requests
        self._within_loads: dict[str, _Request] = {}  # load id -> its request, until every rank loaded
        self._next_load = 0
        self._ranks_mapped: set[int] = set()          # ranks whose worker holds the regions mapped
        self._regions_of_infos: tuple = ()            # the cache regions _infos were made for
        self._infos: dict[int, RegionInfo] = {}       # the regions the step plans name
        self._closed = False
        self.history: deque[dict] = deque(maxlen=256)     # the last finished requests, for operators
        self._reported = {"loaded_tokens": 0, "stored_pages": 0, "engine_s": 0.0}   # at the last stats call
        atexit.register(self.close)      # background writes reach disk even without shutdown()
        check_vllm_version()
        log.info("hybridkv: layout %s, %d groups, RAM %d B, retention %s, tiers %s%s", self.layout.fingerprint(),
                 len(self.layout.groups), config.ram_bytes,
                 "dense" if self.connector.retention.dense else self.connector.retention.interval,
                 self.cache.tier_names[1:] or "RAM only",
                 ", disk/Redis reads in the background" if self.async_promotion and self._below_ram()
                 else "")
        if self._below_ram() and drain_before_stop(self.cache.wait_written) \
                and not getattr(vllm_config, "shutdown_timeout", 0):
            log.info("hybridkv: vLLM kills the engine at once on a stop (--shutdown-timeout 0): "
                     "pages still being written then are lost; --shutdown-timeout 10 lets them land")

    def count_hook(self, name: str, seconds: float) -> None:
        self.stats.engine_s += seconds
        self.stats.hook_s[name] += seconds

    # -- lookup -----------------------------------------------------------------------------
    def match(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` this cache restores (pinned, or being read
        into RAM, when > 0)."""
        t0 = time.perf_counter()
        tokens = self._match(request, num_computed_tokens)
        ms = (time.perf_counter() - t0) * 1e3
        self.stats.match_ms_max = max(self.stats.match_ms_max, ms)
        if request.request_id in self._requests:
            self._requests[request.request_id].match_ms = ms
        return tokens

    def _match(self, request, num_computed_tokens: int) -> int:
        rid = request.request_id
        tokens = request.prompt_token_ids
        salt, extra = request_identity(request)
        ctx = self._requests.get(rid)
        if ctx is not None and self._look_again(ctx, tokens, num_computed_tokens, salt, extra):
            state = ctx.state             # (its record starts afresh: vLLM may have declined a hit)
        else:
            if ctx is not None:           # asked again (allocated, or preempted): start over
                self.finish(rid, final=False)
            if not tokens:
                return 0
            # the same prompt list (vLLM asks again about a request it preempted, or one whose
            # hit it did not take), the same keys
            again = ctx.state if ctx is not None and ctx.tokens is tokens else None
            state = self.connector.begin(rid, tokens, salt, extra=extra, local_tokens=num_computed_tokens,
                                         again=again)
        ctx = self._requests[rid] = _Request(state, tokens, num_computed_tokens)
        self._ask_for_state(request, state)
        if state.hit.tokens <= num_computed_tokens or rid in self._failed_loads:
            return 0                      # (a failed load would only fail again: vLLM recomputes)
        loading = self.connector.start_load(state) if self.async_promotion else self.connector.load(state)
        if loading is None:
            return 0
        ctx.pinned = True
        if state.hit.tokens <= num_computed_tokens:       # the hit shrank while pinning
            self._unpin(ctx)
            return 0
        if self._can_load_within_step(ctx):
            ctx.within_step = True
        elif state.loaded is None:                        # a read into RAM failed: recompute
            ctx.pinned = False
            return 0
        return state.hit.tokens - num_computed_tokens

    def _look_again(self, ctx: _Request, tokens, num_computed_tokens: int, salt, extra) -> bool:
        """vLLM asks each step about a request it could not schedule (about one a step under
        load). With the same prompt list, the same local prefix and nothing pinned or loaded
        for it, the request keeps its state and only its hit is found afresh: finishing,
        keying and beginning it again cost ~100 µs a time (on unique prompts the lookups took
        12% less time without it)."""
        return (ctx.tokens is tokens and ctx.local_tokens == num_computed_tokens and not ctx.pinned
                and not ctx.loaded_tokens and self.connector.look_again(ctx.state, salt, extra))

    def _can_load_within_step(self, ctx: _Request) -> bool:
        """Can the hit's copy run in the step that computes the rest of the prompt (vLLM's
        synchronous load), not in a step of its own before it? When every page is in RAM now
        and every worker has mapped the regions: a copy from pinned slots then cannot fail,
        which matters, because vLLM gives a synchronous load of a hybrid model no way to
        report a failure. (A read into RAM that turns out failed clears ``state.loaded``.)"""
        if not self.within_step or len(self._ranks_mapped) < self.layout.tp_size:
            return False
        if not ctx.state.loaded.ready():
            return False
        return not self.async_promotion or self.connector.finish_load(ctx.state) is not None

    def loads_within_step(self, request_id: str) -> bool:
        """Will the request's load run in the step that schedules it (vLLM: not asynchronous)?"""
        ctx = self._requests.get(request_id)
        return ctx is not None and ctx.within_step

    def _ask_for_state(self, request, state: RequestState) -> None:
        """vLLM materializes a recurrent state only where a chunk ends. Its own stops need not
        fall on this cache's kept boundaries (its tail stop follows the hash block size), so
        ask it to stop at the junction, or else at the prompt's own state (its replay boundary,
        or the learned alignment's multiple below it) when that is missing. vLLM offers one
        such stop per request (``shared_prefix_boundary``)."""
        if not self.connector.state_groups or getattr(request, "shared_prefix_boundary", 1):
            return
        if state.hit.junction and state.retention.align:
            # the junction takes the one stop: keep the prompt's state where vLLM's own stop
            # materializes it, at the replay boundary
            state.retention = dataclasses.replace(state.retention, align=0)
        end = state.retention.prompt_state(state.n_tokens)
        target = state.hit.junction or (end if state.hit.tokens < end else 0)
        if target:
            request.shared_prefix_boundary = target
            self.stats.junctions_requested += bool(state.hit.junction)

    def allocated(self, request, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        """vLLM gave the request its blocks: plan the copies of the pinned hit into them."""
        ctx = self._requests.get(request.request_id)
        if ctx is None or not ctx.pinned:
            return
        if num_external_tokens == 0:      # vLLM chose its local hit after all
            self._unpin(ctx)
            return
        expected = ctx.state.hit.tokens - ctx.local_tokens
        if num_external_tokens != expected and ctx.within_step:
            # vLLM runs the request this step and hears of no failure: computing it from blocks
            # hybridkv did not fill would give wrong tokens (load_within_step excludes the
            # models where vLLM trims a hit, so this is a vLLM change hybridkv does not know)
            raise HybridKVError(f"vLLM accepted {num_external_tokens} external tokens for "
                                f"{request.request_id} but hybridkv pinned {expected} for a load within "
                                "the step; set load_within_step: false in kv_connector_extra_config")
        if num_external_tokens != expected:
            # Blocks of another hit size may not line up with a stored state: load nothing and
            # let vLLM recompute the request (its failure policy), never raise in its scheduler.
            log.warning("hybridkv: vLLM accepted %d external tokens for %s but hybridkv pinned %d; "
                        "the request is recomputed", num_external_tokens, request.request_id, expected)
            self.stats.hits_trimmed += 1
            self._unpin(ctx)
            self._promotion_failed.add(request.request_id)     # the worker reports it failed
            self._failed_loads.add(request.request_id)
            return
        copies = []
        slots = ctx.state.loaded.slots
        for gid, blocks in self.connector.hit_blocks(ctx.state).items():
            targets = [(slot, block_ids[gid][b]) for slot, b in zip(slots[gid], blocks, strict=True)]
            targets = [(slot, block) for slot, block in targets if block != 0]   # 0: vLLM's null block
            if targets:
                copies.append(Copy(gid, [s for s, _ in targets], [b for _, b in targets]))
        if ctx.within_step:               # the step's plan adds the state's running column
            self._within[request.request_id] = copies
            self.stats.loads_within_step += 1
        elif not self.async_promotion:
            self._loads[request.request_id] = copies
        else:                             # to the worker once every page is in RAM
            self._promoting[request.request_id] = copies
            self.stats.promotions_waited += not ctx.state.loaded.ready()
        ctx.loaded_tokens = num_external_tokens
        self.stats.loads += 1
        self.stats.loaded_tokens += num_external_tokens

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, also its cascade after a weight
        update: no page stored so far may be served again (``Connector.forget_all``)."""
        freed = self.connector.forget_all()
        log.info("hybridkv: cache reset: pages stored so far are no longer served; RAM freed %d "
                 "pages%s", freed, ", disk and Redis pages age out" if self._below_ram() else "")
        return True

    def hit_sources(self, request_id: str) -> dict[str, int]:
        """The tokens of the request's load by the tier (``ram``, ``fs``, ``remote``) they came from."""
        ctx = self._requests.get(request_id)
        return dict(ctx.state.token_sources) if ctx is not None and ctx.loaded_tokens else {}

    # -- stores -----------------------------------------------------------------------------
    def _region_infos(self) -> dict[int, RegionInfo]:
        """What a worker needs to map each region, made again only when the cache's regions
        are new: after it re-planned a static split the paths are new, and no rank has mapped
        them, so loads go to steps of their own until each has."""
        regions = tuple(self.cache.regions.values())      # regions compare by identity
        if regions != self._regions_of_infos:
            self._regions_of_infos = regions
            self._infos = {gid: RegionInfo(str(r.path), r.slots, r.page_bytes) for gid, r in self.cache.regions.items()}
            self._ranks_mapped.clear()
        return self._infos

    def plan_step(self, scheduled: dict[str, tuple[int, int]], block_ids_of,
                  handoffs: dict[str, list[tuple[int, int, int]]]) -> StepPlan:
        """The step's loads and stores. ``scheduled`` maps request -> (start, end) tokens,
        ``block_ids_of`` a request to its block ids per group, ``handoffs`` a request to the
        recurrent states vLLM hands off this step: (group, block id, boundary tokens)."""
        self._collect_promotions()
        plan = StepPlan(self._region_infos(), self._loads, {}, self._promotion_failed, self._abandoned)
        self._loads, self._promotion_failed, self._abandoned = {}, set(), set()
        if self._within:
            self._plan_loads_within_step(scheduled, block_ids_of, plan)
        if self.connector.token_groups:
            for rid, (start, end) in scheduled.items():
                ctx = self._requests.get(rid)
                if ctx is not None:
                    self._plan_block_stores(ctx, start, end, block_ids_of, plan)
        for rid, states in handoffs.items():
            ctx = self._requests.get(rid)
            if ctx is not None:
                self._plan_state_stores(ctx, states, plan)
        return plan

    def _plan_loads_within_step(self, scheduled: dict[str, tuple[int, int]], block_ids_of,
                                plan: StepPlan) -> None:
        """Loads whose requests run in this step. Before a step's loads, vLLM copies each
        running request's recurrent state from the column of the token before its chunk into
        the column its chunk ends in (its Mamba pre-copy), and the forward reads that one. So
        a state page loaded now goes into that running column too: for the request loading
        it, and for any other request of this step that hit the same state block in vLLM's own
        cache (vLLM caches a synchronous load's blocks at once; 0.32 runs a request that hits
        them a step later, when they are filled, but nothing in its API promises that)."""
        state_groups = set(self.connector.state_groups)
        loaded: dict[tuple[int, int], tuple[str, int]] = {}     # (group, block) -> (load id, slot)
        for rid, copies in self._within.items():
            # an id of its own: a request preempted and looked up again must not be unpinned
            # by the acknowledgements of this load
            load = f"{rid}#{self._next_load}"
            self._next_load += 1
            self._within_loads[load] = self._requests[rid]
            plan.loads[load] = copies
            plan.loads_within_step.add(load)
            for c in (c for c in copies if c.group in state_groups):
                loaded.update({(c.group, block): (load, slot)
                               for slot, block in zip(c.slots, c.blocks, strict=True)})
        self._within = {}
        for rid, (start, end) in scheduled.items():
            before, running = (start - 1) // self.B, (end - 1) // self.B
            if start == 0 or before == running:
                continue
            block_ids = block_ids_of(rid)
            for gid in state_groups:
                owner = loaded.get((gid, block_ids[gid][before]))
                if owner is not None and block_ids[gid][running] != 0:
                    plan.loads[owner[0]].append(Copy(gid, [owner[1]], [block_ids[gid][running]]))

    def _collect_promotions(self) -> None:
        """Loads whose reads have landed go to the worker now; a load a read failed is handed
        to the worker to report as failed (vLLM then recomputes the request)."""
        for rid in [rid for rid in self._promoting if self._requests[rid].state.loaded.ready()]:
            copies = self._promoting.pop(rid)
            ctx = self._requests[rid]
            if self.connector.finish_load(ctx.state) is not None:
                self._loads[rid] = copies
                continue
            ctx.pinned = False
            self._promotion_failed.add(rid)
            self._failed_loads.add(rid)
            self.stats.promotion_failures += 1

    def _plan_block_stores(self, ctx: _Request, start: int, end: int, block_ids_of, plan: StepPlan) -> None:
        """The prompt blocks the step completed, in one reservation; where RAM cannot take
        them all now, block by block from the first, as far as it can. vLLM is asked for the
        block ids only when the step completed a prompt block (not for a decoding step: asking
        was half of this hook's time on a miss)."""
        state, conn, B, groups = ctx.state, self.connector, self.B, self.connector.token_groups
        completed = range(start // B, min(end // B, len(state.keys)))
        if not completed:
            return
        block_ids = block_ids_of(state.request_id)
        # a block some group no longer holds (sliding window) has nothing to give
        blocks = [j for j in completed if conn.wants_block(state, j) and all(block_ids[gid][j] for gid in groups)]
        if not blocks or (len(blocks) > 1 and self._reserve(ctx, PageKind.ATTENTION, groups, blocks, block_ids, plan)):
            return
        for j in blocks:
            if not self._reserve(ctx, PageKind.ATTENTION, groups, [j], block_ids, plan):
                self.stats.stores_refused += 1
                return

    def _plan_state_stores(self, ctx: _Request, states: list[tuple[int, int, int]], plan: StepPlan) -> None:
        """Only states vLLM handed off are stored, from the exact blocks it named: a block
        of a state group holds a valid state only where vLLM says so."""
        by_boundary: dict[int, dict[int, int]] = {}
        for gid, block_id, boundary in states:
            by_boundary.setdefault(boundary, {})[gid] = block_id
        for boundary, blocks in sorted(by_boundary.items()):
            if boundary % self.B or not 0 < boundary <= len(ctx.state.keys) * self.B:
                continue                  # not on this cache's key grid
            if (set(self.connector.state_groups) <= blocks.keys() and all(blocks.values())
                    and self.connector.wants_state(ctx.state, boundary)):
                block_ids = {gid: {boundary // self.B - 1: block} for gid, block in blocks.items()}
                spare = self.connector.is_spare(ctx.state, PageKind.STATE, boundary)
                if not self._reserve(ctx, PageKind.STATE, self.connector.state_groups, [boundary // self.B - 1],
                                     block_ids, plan, spare) and not spare:
                    self.stats.stores_refused += 1

    def _reserve(self, ctx: _Request, kind: PageKind, groups: list[int], blocks: list[int], block_ids,
                 plan: StepPlan, spare: bool = False) -> bool:
        """One reservation for these blocks' pages in ``groups``; False where RAM refused it.
        ``spare``: only into free room (``Connector.is_spare``)."""
        keys = ctx.state.keys
        plans = self.cache.prepare_store({gid: [keys[j] for j in blocks] for gid in groups}, ctx.state.ticket.cold,
                                         spare)
        if plans is None:
            return False
        block_of = {keys[j]: j for j in blocks}
        copies = [Copy(gid, p.slots, [block_ids[gid][block_of[k]] for k in p.keys])
                  for gid, p in plans.items() if p.keys]
        if copies:                        # (else all stored already)
            rid = self._next_reservation
            self._next_reservation += 1
            self._reservations[rid] = _Reservation(ctx.state.request_id, plans, kind)
            plan.stores[rid] = copies
        return True

    # -- worker reports ---------------------------------------------------------------------
    def on_report(self, report: WorkerReport | None) -> None:
        """Each TP rank reports its slice of a copy, maybe in different steps. A store is
        published once every rank wrote its slice, and abandoned (its slots freed) once every
        rank is done with it and one failed: never a page with a missing slice, never a slot
        freed while a rank still writes it. A hit's pages stay pinned until every rank loaded."""
        for rank, part in (report.ranks.items() if report is not None else ()):
            self.stats.worker_engine_s += part.engine_s
            self.stats.worker_hook_s.update(part.hook_s)
            if part.mapped:
                self._ranks_mapped.add(rank)
            for rid in part.stored | part.store_failures:
                self._acknowledge_store(rid, rank, rid in part.stored and rid not in part.store_failures)
            for req in part.loaded | part.load_failures:
                self._acknowledge_load(req, rank, req in part.load_failures)
        self.cache.poll()

    def _acknowledge_store(self, rid: int, rank: int, ok: bool) -> None:
        res = self._reservations.get(rid)
        if res is None or not res.acks.add(rank, ok, self.layout.tp_size):
            return
        del self._reservations[rid]
        self.cache.complete_store(res.plans, res.acks.ok)
        if not res.acks.ok:
            self.stats.store_failures += 1
            return
        pages = sum(len(p.keys) for p in res.plans.values())
        self.connector.stats["pages_stored"] += pages
        self.connector.stats["spare_states"] += any(p.spare for p in res.plans.values())
        owner = self._requests.get(res.request)
        if owner is not None:
            owner.state.stored[res.kind.value] += pages

    def _acknowledge_load(self, req: str, rank: int, failed: bool) -> None:
        acks = self._load_acks.setdefault(req, _Acks())
        if not acks.add(rank, not failed, self.layout.tp_size):
            return
        del self._load_acks[req]
        if not acks.ok:                   # no hit again: vLLM recomputes the request
            if req in self._requests:     # (a finished request's id is not kept)
                self._failed_loads.add(req)
            self.stats.load_failures += 1
        ctx = self._within_loads.pop(req, None) or self._requests.get(req)
        if ctx is not None and ctx.pinned and self._requests.get(ctx.state.request_id) is ctx:
            self._unpin(ctx)              # (a request finished or looked up again unpinned already)

    def _unpin(self, ctx: _Request) -> None:
        self.connector.release(ctx.state)
        ctx.pinned = False

    def pending_stores(self) -> bool:
        """Stores some rank has not reported yet (a GPU copy completes a step or more after
        it was queued): vLLM keeps stepping while there are any, so they get published."""
        return bool(self._reservations)

    # -- lifetimes --------------------------------------------------------------------------
    def finish(self, request_id: str, final: bool = True) -> None:
        """The request is done (``final``) or about to be looked up afresh."""
        if final:
            self._failed_loads.discard(request_id)
        ctx = self._requests.pop(request_id, None)
        self._loads.pop(request_id, None)
        self._within.pop(request_id, None)
        if self._promoting.pop(request_id, None) is not None:
            self._abandoned.add(request_id)   # aborted while its reads were in flight
        if ctx is not None:
            self.history.append({"request": request_id, "prompt_tokens": ctx.state.n_tokens,
                                 "local_tokens": ctx.local_tokens, "loaded_tokens": ctx.loaded_tokens,
                                 "match_ms": round(ctx.match_ms, 3),
                                 "sources": dict(ctx.state.sources) if ctx.loaded_tokens else {},
                                 "stored": dict(ctx.state.stored)})
            self.connector.finish(ctx.state, done=final)
        if self.stats_file is not None and not self._closed and self.stats_file.due():
            self.stats_file.write_soon(self.summary())

    def take_counters(self) -> dict:
        """What changed since the last call (vLLM sums these per logging interval)."""
        now = {"loaded_tokens": self.stats.loaded_tokens,
               "stored_pages": self.connector.stats["pages_stored"], "engine_s": self.stats.engine_s}
        delta = {k: v - self._reported[k] for k, v in now.items()}
        if not delta["loaded_tokens"] and not delta["stored_pages"] and delta["engine_s"] < ENGINE_S_ALONE:
            return dict.fromkeys(delta, 0)     # the hook time goes with the next change
        self._reported = now
        return delta

    def summary(self) -> dict:
        """A snapshot in containers of its own (the stats file's writer thread reads it while
        the engine goes on)."""
        vllm = {**vars(self.stats), "hook_s": dict(self.stats.hook_s),
                "worker_hook_s": dict(self.stats.worker_hook_s), "async_promotion": self.async_promotion,
                "stats_write_errors": self.stats_file.errors if self.stats_file is not None else 0}
        return {"connector": dict(self.connector.stats), "vllm": vllm,
                "requests": list(self.history),
                "cache": self.cache.stats(), "layout": self.layout.fingerprint(),
                "block_tokens": self.B}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.connector.reference = None             # no re-plan of RAM on the way out
        for rid in list(self._requests):
            self.finish(rid)
        self.cache.drain()
        if self.stats_file is not None:     # before close: closed tiers report nothing
            self.stats_file.write_now(self.summary())
        log.info("hybridkv: closing after %d requests: %d tokens loaded, %d pages stored; tiers %s",
                 self.connector.stats["requests"], self.stats.loaded_tokens,
                 self.connector.stats["pages_stored"], self._tier_summary())
        self.cache.close()
        atexit.unregister(self.close)

    def _tier_summary(self) -> str:
        """What each tier below RAM took and served, for the closing log line."""
        tiers = self.cache.stats()["tiers"]
        return ", ".join(f"{name}: {tiers[name].get('writes', 0)} pages written, "
                         f"{tiers[name]['hits']} served, {tiers[name].get('write_errors', 0)} "
                         "write errors" for name in self.cache.tier_names[1:]) or "none"

    def _below_ram(self) -> bool:
        """Has the cache a tier below RAM (disk, Redis)?"""
        return len(self.cache.tier_names) > 1
