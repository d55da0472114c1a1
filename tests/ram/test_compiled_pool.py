"""The compiled pool against the Python pool: the same operations must give the same answers.

The Python pool (ram/pool.py + ram/policies.py) is the specification; the compiled pool
(ram/_slotpool.c) must choose the same victims, report the same lookups, pins and counts
and hand out the same slots (the slot order may differ only after ``reset``, which frees idle
keys in another order).
"""

import random
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hybridkv.ram.compiled_pool import CompiledSlotPool
from hybridkv.ram.grouped_pools import GroupedPools
from hybridkv.ram.policies import LRUPolicy
from hybridkv.ram.pool import Lookup, SlotPool, make_pool

KEYS = 16


class SideBySide:
    """Both pools, every call made on each and the answers compared."""

    def __init__(self, capacity: int, policy: str):
        self.python = SlotPool(3, capacity, policy)
        self.compiled = CompiledSlotPool(3, capacity, policy)
        self.slots_may_differ = False

    def call(self, name: str, *args):
        outcomes = []
        for pool in (self.python, self.compiled):
            try:
                outcomes.append(("ok", getattr(pool, name)(*args)))
            except (KeyError, ValueError) as exc:
                outcomes.append(("raised", type(exc)))
        (kind_p, got_p), (kind_c, got_c) = outcomes
        assert kind_p == kind_c, (name, args, outcomes)
        if name == "prepare_store" and got_p is not None and got_c is not None:
            assert (got_p.keys, got_p.evicted) == (got_c.keys, got_c.evicted), (name, args)
            if not self.slots_may_differ:
                assert got_p.slots == got_c.slots
        elif name == "prepare_load" and kind_p == "ok":
            assert self.slots_may_differ or got_p == got_c
        elif name == "oldest":      # each pool type keeps its own clock: compare what it says
            assert (got_p is None, got_p == 0) == (got_c is None, got_c == 0), outcomes
        elif name == "set_capacity" and self.slots_may_differ:
            assert (got_p is None) == (got_c is None), outcomes
        elif name != "reset":
            assert got_p == got_c, (name, args, outcomes)
        if name == "reset":
            self.slots_may_differ = True
        return got_p

    def check(self, universe):
        p, c = self.python, self.compiled
        assert (len(p), p.free_count(), p.evictable_count(), p.slots_used) == \
            (len(c), c.free_count(), c.evictable_count(), c.slots_used)
        assert p.snapshot_stats() == c.snapshot_stats()
        for key in universe:
            assert p.lookup(key) is c.lookup(key), key
            assert p.refs_of(key) == c.refs_of(key), key
            assert (key in p) == (key in c)
        assert sorted(p.resident_keys()) == sorted(c.resident_keys())
        slots = [c.slot_of(k) for k in c.resident_keys()]
        assert len(set(slots)) == len(slots) and all(0 <= s < c.capacity for s in slots)
        if not isinstance(p.policy, LRUPolicy):
            assert p.policy.target_t1 == c.target_t1


class SameAnswers(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "arc"]), capacity=st.integers(1, 6))
    def create(self, policy, capacity):
        self.pools = SideBySide(capacity, policy)
        self.policy = policy

    keys = st.lists(st.integers(0, KEYS - 1), max_size=5)

    @rule(keys=keys)
    def store(self, keys):
        self.pools.call("prepare_store", keys)

    @rule(keys=keys, use_new=st.booleans())
    def store_checked(self, keys, use_new):
        """The grouped pools' way: can_place, then prepare_store with new_keys."""
        new = self.pools.call("new_keys", keys)
        if self.pools.call("can_place", keys, new):
            assert self.pools.call("prepare_store", keys, new if use_new else None) is not None

    @rule(keys=keys, success=st.booleans())
    def complete_store(self, keys, success):
        self.pools.call("complete_store", keys, success)

    @rule(keys=keys)
    def load(self, keys):
        self.pools.call("prepare_load", keys)

    @rule(keys=keys)
    def unload(self, keys):
        self.pools.call("complete_load", keys)

    @rule(keys=keys)
    def touch(self, keys):
        self.pools.call("touch", keys)

    @rule(keys=keys)
    def mark_cold(self, keys):
        """Pending, evictable, pinned or absent keys alike: each pool must order them the same."""
        self.pools.call("mark_cold", keys)

    @rule()
    def reset(self):
        self.pools.call("reset")

    @rule(n=st.integers(0, 3))
    def evict_lru(self, n):
        self.pools.call("evict_lru", n)

    @rule(capacity=st.integers(1, 8))
    def set_capacity(self, capacity):
        """Pools sharing one budget grow and shrink (LRU only: ARC sizes its lists by it)."""
        if self.policy == "lru":
            self.pools.call("set_capacity", capacity)

    @rule()
    def oldest(self):
        if self.policy == "lru":
            self.pools.call("oldest")

    @rule(limit=st.integers(0, 8))
    def older_than(self, limit):
        """Each pool counts on its own clock: none below its oldest stamp, all below any to come."""
        if self.policy == "lru":
            for pool in (self.pools.python, self.pools.compiled):
                if pool.oldest() is not None:
                    assert pool.older_than(pool.oldest(), limit) == 0
            self.pools.call("older_than", 1 << 63, limit)

    @invariant()
    def agree(self):
        self.pools.check(range(KEYS))


TestSameAnswers = SameAnswers.TestCase
TestSameAnswers.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_long_random_trace_agrees(policy):
    """Tens of thousands of operations over a pool that grows its table and fills its ghost
    lists many times: bytes keys as the engine uses them, requests of several keys."""
    rng = random.Random(7)
    pools = SideBySide(200, policy)
    universe = [i.to_bytes(32, "little") for i in range(700)]
    pinned: list = []
    for step in range(30_000):
        keys = rng.sample(universe[: rng.choice((250, 700))], rng.choice((1, 1, 1, 4, 16)))
        op = rng.random()
        if op < 0.45:
            plan = pools.call("prepare_store", keys)
            if plan is not None:
                if rng.random() < 0.3:        # a store the insertion policy sends in cold
                    pools.call("mark_cold", plan.keys)
                pools.call("complete_store", plan.keys, rng.random() < 0.95)
        elif op < 0.75:
            pools.call("touch", keys)
        elif op < 0.9:
            loadable = [k for k in keys if pools.python.lookup(k) is Lookup.HIT]
            if loadable:
                pools.call("prepare_load", loadable)
                pinned.append(loadable)
        elif pinned:
            pools.call("complete_load", pinned.pop(rng.randrange(len(pinned))))
        if step % 1000 == 0:
            pools.check(universe)
    pools.check(universe)
    assert pools.python.evictions > 10_000


def test_make_pool_picks_the_compiled_pool_for_built_in_policies(monkeypatch):
    assert type(make_pool(0, 4, "lru")) is CompiledSlotPool
    assert type(make_pool(0, 4, "arc")) is CompiledSlotPool
    assert type(make_pool(0, 4, LRUPolicy(4))) is SlotPool       # a policy object: Python
    assert type(GroupedPools({0: 4}, "arc").pool(0)) is CompiledSlotPool
    monkeypatch.setenv("HYBRIDKV_PURE_PYTHON_POOL", "1")
    assert type(make_pool(0, 4, "lru")) is SlotPool


def test_make_pool_falls_back_to_python_without_the_extension(monkeypatch):
    monkeypatch.setitem(sys.modules, "hybridkv.ram.compiled_pool", None)   # import raises
    pools = GroupedPools({0: 2}, "arc")
    assert type(pools.pool(0)) is SlotPool
    plans = pools.prepare_store({0: [b"a"]})
    pools.complete_store({0: plans[0].keys})
    assert pools.lookup(0, b"a") is Lookup.HIT


def test_bad_arguments_are_refused_and_change_nothing():
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        CompiledSlotPool(0, 4, "mru")
    with pytest.raises(ValueError, match="group 1: a pool needs at least one slot"):
        CompiledSlotPool(1, 0)
    pool = CompiledSlotPool(0, 2)
    pool.complete_store(pool.prepare_store([b"a"]).keys)
    with pytest.raises(ValueError, match="already resident"):
        pool.prepare_store([b"a", b"b"], [b"a", b"b"])
    with pytest.raises(ValueError, match="repeats a key"):
        pool.prepare_store([b"b"], [b"b", b"b"])
    with pytest.raises(TypeError):
        pool.prepare_store([["unhashable"]])
    with pytest.raises(ValueError, match="complete_load without prepare_load"):
        pool.complete_load([b"a"])
    assert len(pool) == 1 and pool.free_count() == 1 and pool.lookup(b"b") is Lookup.MISS
    assert pool.snapshot_stats()["stores"] == 1 and pool.lookup(b"a") is Lookup.HIT


def test_a_huge_pool_costs_what_it_holds():
    """The simulator's pageless pools have hundreds of millions of slots: nothing is
    allocated per slot up front."""
    import tracemalloc

    tracemalloc.start()
    pool = CompiledSlotPool(0, 800_000_000, "arc")
    pool.complete_store(pool.prepare_store([b"a", b"b"]).keys)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1_000_000 and pool.free_count() == 800_000_000 - 2


def test_keys_outlive_the_caller_and_are_released_with_the_pool():
    """The pool holds its own references: keys built and dropped by the caller stay usable,
    and a dropped pool releases them (no leak across many pools)."""
    key = b"k" * 40
    before = sys.getrefcount(key)
    pools = [CompiledSlotPool(0, 8, "arc") for _ in range(50)]
    for pool in pools:
        pool.complete_store(pool.prepare_store([key, bytes(bytearray(b"x" * 40))]).keys)
        assert pool.lookup(b"x" * 40) is Lookup.HIT
    assert sys.getrefcount(key) == before + 50
    del pools, pool
    assert sys.getrefcount(key) == before
