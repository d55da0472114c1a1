import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.ram.compiled_pool import CompiledSlotPool
from hybridkv.ram.grouped_pools import GroupedPools
from hybridkv.ram.pool import Lookup, SlotPool

POLICIES = ["lru", "arc"]
IMPLEMENTATIONS = {"python": SlotPool, "compiled": CompiledSlotPool}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def new_pool(request):
    """Every behaviour test runs on both pools: the compiled one and its Python fallback."""
    return IMPLEMENTATIONS[request.param]


def stored(pool, keys):
    plan = pool.prepare_store(keys)
    assert plan is not None
    pool.complete_store(plan.keys)
    return plan


@pytest.mark.parametrize("policy", POLICIES)
def test_write_pending_is_invisible_then_loadable(new_pool, policy):
    pool = new_pool(0, 4, policy)
    plan = pool.prepare_store(["a", "b"])
    assert plan.keys == ["a", "b"] and sorted(plan.slots) == [0, 1]
    assert pool.lookup("a") is Lookup.HIT_PENDING
    with pytest.raises(KeyError):
        pool.prepare_load(["a"])
    pool.complete_store(["a", "b"])
    assert pool.lookup("a") is Lookup.HIT and pool.lookup("zz") is Lookup.MISS


@pytest.mark.parametrize("policy", POLICIES)
def test_all_pinned_refuses_then_retry_succeeds(new_pool, policy):
    pool = new_pool(0, 2, policy)
    stored(pool, ["a", "b"])
    pool.prepare_load(["a", "b"])
    assert pool.prepare_store(["c"]) is None
    assert pool.lookup("a") is Lookup.HIT and pool.lookup("b") is Lookup.HIT
    pool.complete_load(["a"])
    plan = pool.prepare_store(["c"])
    assert plan.evicted == ["a"] and pool.lookup("a") is Lookup.MISS
    assert pool.lookup("b") is Lookup.HIT


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_store_frees_its_slots(new_pool, policy):
    pool = new_pool(0, 2, policy)
    plan = pool.prepare_store(["a", "b"])
    pool.complete_store(plan.keys, success=False)
    assert pool.free_count() == 2 and len(pool) == 0
    assert pool.lookup("a") is Lookup.MISS
    stored(pool, ["c", "d"])


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_is_all_or_nothing_and_spares_the_calls_keys(new_pool, policy):
    pool = new_pool(0, 3, policy)
    stored(pool, ["a", "b", "c"])
    pool.prepare_load(["b"])
    # needs 2 evictions; only "a" and "c" are evictable but "c" belongs to this call
    assert pool.prepare_store(["c", "x", "y"]) is None
    assert len(pool) == 3 and pool.lookup("a") is Lookup.HIT and pool.lookup("c") is Lookup.HIT
    plan = pool.prepare_store(["c", "x"])
    assert plan.keys == ["x"] and plan.evicted == ["a"]


@pytest.mark.parametrize("policy", POLICIES)
def test_present_and_inflight_keys_are_untouched(new_pool, policy):
    pool = new_pool(0, 4, policy)
    stored(pool, ["a"])
    pending = pool.prepare_store(["b"])
    again = pool.prepare_store(["a", "b", "c", "c"])
    assert again.keys == ["c"]
    assert pool.slot_of("b") == pending.slots[0]


def test_lru_touch_keeps_prefix_more_recent_than_tail(new_pool):
    pool = new_pool(0, 4, "lru")
    stored(pool, ["p0", "p1", "p2", "p3"])
    pool.touch(["p0", "p1", "p2", "p3"])
    assert pool.prepare_store(["n1"]).evicted == ["p3"]
    assert pool.prepare_store(["n2"]).evicted == ["p2"]


def test_lru_pinned_keys_leave_the_order(new_pool):
    pool = new_pool(0, 2, "lru")
    stored(pool, ["a", "b"])
    pool.prepare_load(["a"])
    assert pool.evictable_count() == 1
    pool.complete_load(["a"])
    # "a" came back as most recent, so "b" is the victim
    assert pool.prepare_store(["c"]).evicted == ["b"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_cold_store_is_evicted_before_older_pages_until_a_hit_uses_it(new_pool, policy):
    pool = new_pool(0, 3, policy)
    stored(pool, ["old1", "old2"])
    plan = pool.prepare_store(["cold"])
    pool.mark_cold(plan.keys)
    pool.complete_store(plan.keys)
    assert pool.prepare_store(["n1"]).evicted == ["cold"]       # not old1, the oldest
    pool.complete_store(["n1"])
    assert pool.prepare_store(["n2"]).evicted == ["old1"]      # the others: plain order


@pytest.mark.parametrize("policy", POLICIES)
def test_a_cold_page_used_by_a_hit_becomes_recent(new_pool, policy):
    pool = new_pool(0, 3, policy)
    stored(pool, ["old"])
    plan = pool.prepare_store(["c1", "c2"])
    pool.mark_cold(plan.keys)
    pool.complete_store(plan.keys)
    pool.prepare_load(["c1"])                   # a hit: pinned, released, touched
    pool.complete_load(["c1"])
    pool.touch(["c1"])
    evicted = pool.prepare_store(["n1", "n2"]).evicted
    assert set(evicted) == {"c2", "old"} and evicted[0] == "c2"


def test_a_cold_page_released_after_a_pin_goes_back_to_the_cold_end(new_pool):
    """A write-through pins a page right after its store; releasing it must not warm it."""
    pool = new_pool(0, 3, "lru")
    plan = pool.prepare_store(["cold"])
    pool.mark_cold(plan.keys)
    pool.complete_store(plan.keys)
    stored(pool, ["a", "b"])
    pool.prepare_load(["cold"])
    pool.complete_load(["cold"])
    assert pool.prepare_store(["n"]).evicted == ["cold"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_cold_page_a_hit_used_stays_ordinary_after_a_later_pin(new_pool, policy):
    """A spare state a hit used is then written through (pinned, released): it must not fall
    back to the evicted-first end, or the state that served is the first to go."""
    pool = new_pool(0, 3, policy)
    plan = pool.prepare_store(["used"])
    pool.mark_cold(plan.keys)
    pool.complete_store(plan.keys)
    pool.prepare_load(["used"])                 # the hit
    pool.complete_load(["used"])
    pool.touch(["used"])
    stored(pool, ["a", "b"])
    pool.prepare_load(["used"])                 # its write-through
    pool.complete_load(["used"])
    assert pool.prepare_store(["n"]).evicted == ["a"]


def test_marking_an_evictable_page_cold_moves_it_at_once(new_pool):
    pool = new_pool(0, 3, "lru")
    stored(pool, ["a", "b", "c"])
    pool.mark_cold(["c", "absent"])
    assert pool.prepare_store(["n"]).evicted == ["c"]


def test_a_state_whose_block_left_ram_is_evicted_before_older_states():
    """A hit needs the attention page of the block a state ends: without it the state cannot
    serve from RAM, so it is the first state to go."""
    mgr = GroupedPools({0: 2, 1: 2}, state_groups=[1])
    for key in ("a", "b"):
        mgr.prepare_store({0: [key], 1: [key]})
        mgr.complete_store({0: [key], 1: [key]})
    mgr.touch({0: ["a"]})                                   # attention page "b" is the LRU one
    assert mgr.prepare_store({0: ["c"]})[0].evicted == ["b"]
    mgr.complete_store({0: ["c"]})
    assert mgr.prepare_store({1: ["d"]})[1].evicted == ["b"]     # not "a", the older state
    plain = GroupedPools({0: 2, 1: 2})                       # told no state groups: plain LRU
    for key in ("a", "b"):
        plain.prepare_store({0: [key], 1: [key]})
        plain.complete_store({0: [key], 1: [key]})
    plain.touch({0: ["a"]})
    plain.prepare_store({0: ["c"]})
    plain.complete_store({0: ["c"]})
    assert plain.prepare_store({1: ["d"]})[1].evicted == ["a"]


def test_grouped_cold_store_marks_every_group():
    mgr = GroupedPools({0: 2, 1: 2})
    for key in ("a", "b"):
        plans = mgr.prepare_store({0: [key], 1: [key]}, cold=key == "b")
        mgr.complete_store({gid: plan.keys for gid, plan in plans.items()})
    plans = mgr.prepare_store({0: ["c"], 1: ["c"]})
    assert plans[0].evicted == ["b"] and plans[1].evicted == ["b"]


def test_a_spare_store_takes_free_slots_only_and_enters_cold():
    mgr = GroupedPools({0: 3, 1: 2})
    plans = mgr.prepare_store({0: ["a"], 1: ["a"]})
    mgr.complete_store({gid: plan.keys for gid, plan in plans.items()})
    spare = mgr.prepare_store({0: ["s"], 1: ["s"]}, spare=True)
    assert spare[0].spare and spare[1].spare and not plans[0].spare
    mgr.complete_store({gid: plan.keys for gid, plan in spare.items()})
    assert mgr.free_slots(0) == 1 and mgr.free_slots(1) == 0
    # group 1 is full: another spare is refused whole, nothing evicted in either group
    assert mgr.prepare_store({0: ["t"], 1: ["t"]}, spare=True) is None
    assert "a" in mgr.pool(1) and "s" in mgr.pool(1) and "t" not in mgr.pool(0)
    assert mgr.pool(1).store_refusals == 0
    # a kept page may evict, and the spare (cold) goes first though it is younger
    plans = mgr.prepare_store({0: ["k"], 1: ["k"]})
    assert plans[1].evicted == ["s"]


def arc_state(pool):
    """Where a pool keeps ARC's target: its policy object (Python) or itself (compiled)."""
    return pool.policy if isinstance(pool, SlotPool) else pool


def test_arc_falls_back_to_the_other_list(new_pool):
    pool = new_pool(0, 4, "arc")
    stored(pool, ["a", "b"])
    pool.touch(["a", "b"])                      # a, b -> T2
    stored(pool, ["c", "d"])                    # c, d -> T1
    arc_state(pool).target_t1 = 4.0             # prefer evicting from T2 ...
    pool.prepare_load(["a", "b"])               # ... where nothing is evictable
    plan = pool.prepare_store(["e"])
    assert plan is not None and plan.evicted == ["c"]


def test_arc_frequency_protects_reused_keys_and_ghosts_adapt(new_pool):
    pool = new_pool(0, 3, "arc")
    stored(pool, ["hot"])
    pool.touch(["hot"])
    for i in range(6):
        stored(pool, [f"scan{i}"])
    assert pool.lookup("hot") is Lookup.HIT
    before = arc_state(pool).target_t1
    stored(pool, ["scan3"])                     # a ghost from B1 comes back
    assert arc_state(pool).target_t1 > before


def test_grouped_store_is_atomic_across_groups():
    mgr = GroupedPools({0: 4, 2: 1})
    plans = mgr.prepare_store({0: ["a0"], 2: ["s0"]})
    mgr.complete_store({0: plans[0].keys, 2: plans[2].keys})
    mgr.prepare_load({2: ["s0"]})
    # group 2 cannot place s1 (its only slot is pinned): nothing in group 0 changes
    assert mgr.prepare_store({0: ["a1", "a2"], 2: ["s1"]}) is None
    assert len(mgr.pool(0)) == 1 and mgr.lookup(0, "a1") is Lookup.MISS
    mgr.complete_load({2: ["s0"]})
    plans = mgr.prepare_store({0: ["a1", "a2"], 2: ["s1"]})
    assert plans[2].evicted == ["s0"] and plans[0].keys == ["a1", "a2"]


def test_grouped_refusal_evicts_nothing_elsewhere():
    mgr = GroupedPools({0: 1, 1: 1})
    for gid, key in ((0, "a"), (1, "s")):
        mgr.complete_store({gid: mgr.prepare_store({gid: [key]})[gid].keys})
    mgr.prepare_load({1: ["s"]})
    assert mgr.prepare_store({0: ["b"], 1: ["t"]}) is None
    assert mgr.lookup(0, "a") is Lookup.HIT   # not evicted for a store that was refused


def test_request_finish_releases_leaked_pins():
    mgr = GroupedPools({0: 2})
    mgr.complete_store({0: mgr.prepare_store({0: ["a"]})[0].keys})
    mgr.request_started("r1")
    mgr.prepare_load({0: ["a"]}, request="r1")
    assert mgr.pool(0).refs_of("a") == 1
    assert mgr.request_finished("r1") == 1
    assert mgr.pool(0).refs_of("a") == 0


def test_reset_keeps_pinned_and_pending(new_pool):
    pool = new_pool(0, 4, "lru")
    stored(pool, ["a", "b"])
    pool.prepare_load(["a"])
    pool.prepare_store(["c"])
    pool.reset()
    assert pool.lookup("b") is Lookup.MISS
    assert pool.lookup("a") is Lookup.HIT and pool.lookup("c") is Lookup.HIT_PENDING


class PoolModel(RuleBasedStateMachine):
    """Random operation sequences against a plain reference model of what must hold."""

    def __init__(self):
        super().__init__()
        self.pool = None
        self.pinned: dict = {}      # key -> pins we hold
        self.pending: set = set()
        self.completed: set = set()

    @rule(impl=st.sampled_from(sorted(IMPLEMENTATIONS)), policy=st.sampled_from(POLICIES),
          capacity=st.integers(1, 6))
    @precondition(lambda self: self.pool is None)
    def create(self, impl, policy, capacity):
        self.pool = IMPLEMENTATIONS[impl](0, capacity, policy)

    @rule(keys=st.lists(st.integers(0, 12), min_size=1, max_size=4))
    @precondition(lambda self: self.pool is not None)
    def store(self, keys):
        plan = self.pool.prepare_store(keys)
        if plan is None:
            return
        for k in plan.evicted:
            assert k not in self.pinned and k not in self.pending and k not in keys
            self.completed.discard(k)
        self.pending.update(plan.keys)

    @rule(data=st.data(), success=st.booleans())
    @precondition(lambda self: self.pool is not None and self.pending)
    def finish_store(self, data, success):
        key = data.draw(st.sampled_from(sorted(self.pending)))
        self.pool.complete_store([key], success)
        self.pending.discard(key)
        if success:
            self.completed.add(key)

    @rule(data=st.data())
    @precondition(lambda self: self.pool is not None and self.completed)
    def pin(self, data):
        key = data.draw(st.sampled_from(sorted(self.completed)))
        self.pool.prepare_load([key])
        self.pinned[key] = self.pinned.get(key, 0) + 1

    @rule(data=st.data())
    @precondition(lambda self: self.pool is not None and self.pinned)
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(self.pinned)))
        self.pool.complete_load([key])
        self.pinned[key] -= 1
        if not self.pinned[key]:
            del self.pinned[key]

    @rule(keys=st.lists(st.integers(0, 12), max_size=4))
    @precondition(lambda self: self.pool is not None)
    def touch(self, keys):
        self.pool.touch(keys)

    @invariant()
    def accounting(self):
        pool = self.pool
        if pool is None:
            return
        assert pool.free_count() + len(pool) == pool.capacity
        slots = [pool.slot_of(k) for k in pool.resident_keys()]
        assert len(slots) == len(set(slots)) and all(0 <= s < pool.capacity for s in slots)
        for k in self.pinned:
            assert pool.lookup(k) is Lookup.HIT
        for k in self.pending:
            assert pool.lookup(k) is Lookup.HIT_PENDING
        for k in range(13):
            if pool.lookup(k) is Lookup.HIT:
                assert k in self.completed
        evictable = sum(1 for k in self.completed if k not in self.pinned)
        assert pool.evictable_count() == evictable


TestPoolModel = PoolModel.TestCase
TestPoolModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- pools sharing one budget: recency across pools, eviction on demand, capacity moves ------
def test_oldest_compares_recency_across_pools(new_pool):
    first, second = new_pool(0, 4, "lru"), new_pool(1, 4, "lru")
    assert first.oldest() is None
    stored(first, ["a", "b"])
    stored(second, ["x"])
    assert first.oldest() < second.oldest()          # "a" was stored before "x"
    first.touch(["a", "b"])
    assert first.oldest() > second.oldest()          # now "x" is the older page
    second.mark_cold(["x"])
    assert second.oldest() == 0


def test_evict_lru_takes_the_pages_eviction_would(new_pool):
    pool = new_pool(0, 4, "lru")
    stored(pool, ["a", "b", "c"])
    pool.touch(["a"])
    assert pool.evict_lru(2) == ["b", "c"] and pool.free_count() == 3
    pool.prepare_load(["a"])
    assert pool.evict_lru(1) is None and "a" in pool   # pinned: nothing to take


def test_shrinking_moves_the_pages_past_the_end_into_free_slots(new_pool):
    pool = new_pool(0, 3, "lru")
    stored(pool, ["a", "b", "c"])                     # slots 0, 1, 2
    assert pool.set_capacity(2) is None               # no free slot below for "c"
    pool.evict_lru(1)                                 # "a" leaves slot 0
    pool.prepare_load(["c"])
    assert pool.set_capacity(2) is None and pool.capacity == 3     # a pinned page stays put
    pool.complete_load(["c"])
    assert pool.set_capacity(2) == [("c", 2, 0)]
    assert pool.capacity == 2 and pool.free_count() == 0 and pool.slot_of("c") == 0
    assert pool.set_capacity(4) == [] and pool.free_count() == 2
    plan = pool.prepare_store(["d", "e"])
    assert sorted(plan.slots) == [2, 3] and not plan.evicted
