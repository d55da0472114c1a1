"""Eviction policies for one slot pool.

The pool tells the policy which resident keys are *evictable* (stored, not pinned); the
policy keeps only the order and answers ``evict(n, protected)`` all-or-nothing. A new
policy subclasses ``EvictionPolicy`` and registers in ``POLICIES``; pools never change.

LRU also stamps each evictable key with when it last became most recent (``RECENCY``, one
clock for every pool of the process; 0 for a key stored cold), so pools that share one
budget can tell whose least recently used page is older (``oldest``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence

RECENCY = itertools.count(1)


class EvictionPolicy:
    """Recency/frequency bookkeeping for one pool. All methods are O(1) per key."""

    def inserted(self, key: Hashable) -> None:
        """A new key became resident (write-pending, so not yet evictable)."""

    def set_evictable(self, key: Hashable, evictable: bool) -> None:
        raise NotImplementedError

    def removed(self, key: Hashable) -> None:
        """The key left the pool without eviction (failed store, reset)."""
        raise NotImplementedError

    def touch(self, keys: Sequence[Hashable]) -> None:
        """Keys of one request, in prefix order, were used; the prefix ends up most recent."""
        raise NotImplementedError

    def evict(self, n: int, protected: Collection[Hashable]) -> list | None:
        """Choose and forget ``n`` evictable keys not in ``protected``, or None (no change)."""
        raise NotImplementedError

    def demote(self, key: Hashable) -> None:
        """Put an evictable key where this policy evicts first (a page stored cold)."""
        raise NotImplementedError

    def evictable_count(self) -> int:
        raise NotImplementedError

    def oldest(self) -> int | None:
        """The recency stamp of the key eviction takes next, None where none is evictable."""
        raise NotImplementedError

    def older_than(self, stamp: int, limit: int) -> int:
        """How many of the keys eviction takes first have a stamp below ``stamp`` (at most ``limit``)."""
        raise NotImplementedError

    def is_evictable(self, key: Hashable) -> bool:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError


def _take(it: Iterator, protected: Collection, n: int, out: list) -> None:
    """Append up to n keys from ``it`` that are not protected (iterator keeps its place)."""
    for key in it:
        if key not in protected:
            out.append(key)
            if len(out) >= n:
                return


class LRUPolicy(EvictionPolicy):
    """Least recently used; only evictable keys live in the order structure, each with its
    recency stamp."""

    def __init__(self, capacity: int):
        self._order: OrderedDict = OrderedDict()

    def set_evictable(self, key, evictable):
        if evictable:
            self._order[key] = next(RECENCY)
        else:
            self._order.pop(key, None)

    def removed(self, key):
        self._order.pop(key, None)

    def demote(self, key):
        self._order.move_to_end(key, last=False)
        self._order[key] = 0

    def touch(self, keys):
        order = self._order
        move = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key)
                order[key] = next(RECENCY)

    def oldest(self):
        for stamp in self._order.values():
            return stamp
        return None

    def older_than(self, stamp, limit):
        n = 0
        for seen in self._order.values():
            if n >= limit or seen >= stamp:
                break
            n += 1
        return n

    def evict(self, n, protected):
        if n == 1:  # the common case: one victim, stop at the first unprotected key
            order = self._order
            for key in order:
                if key not in protected:
                    del order[key]
                    return [key]
            return None
        if n <= 0:
            return []
        if len(self._order) < n:
            return None
        victims: list = []
        _take(iter(self._order), protected, n, victims)
        if len(victims) < n:
            return None
        pop = self._order.pop
        for key in victims:
            pop(key)
        return victims

    def evictable_count(self):
        return len(self._order)

    def is_evictable(self, key):
        return key in self._order

    def clear(self):
        self._order.clear()


class CostAwareLRU(LRUPolicy):
    """LRU weighed by what a page saves: among the ``window`` least recently used evictable
    keys, evict the lowest ``recency + alpha * cost``, both scaled to [0, 1] over the window
    (the utility Marconi, MLSys 2025, scores radix-tree nodes by). ``cost(key)`` is the
    recompute a page saves per byte (None counts as 0); ``alpha=0`` is plain LRU."""

    def __init__(self, capacity: int, cost: Callable[[Hashable], float | None], alpha: float = 1.0,
                 window: int = 64):
        super().__init__(capacity)
        self.cost, self.alpha, self.window = cost, alpha, window

    def evict(self, n, protected):
        if self.alpha == 0 or n <= 0:
            return super().evict(n, protected)
        victims: list = []
        for _ in range(n):
            window: list = []
            _take(iter(self._order), protected, self.window, window)
            if not window:
                for key in reversed(victims):     # all-or-nothing: put the chosen ones back
                    self._order[key] = 0
                    self._order.move_to_end(key, last=False)
                return None
            costs = [self.cost(key) or 0.0 for key in window]
            lo, span = min(costs), (max(costs) - min(costs)) or 1.0
            last = max(1, len(window) - 1)
            best = min(range(len(window)), key=lambda i: i / last + self.alpha * (costs[i] - lo) / span)
            victims.append(window[best])
            del self._order[window[best]]
        return victims


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement cache: T1 (seen once) / T2 (seen again) with ghost lists B1/B2.

    Differs from vLLM's ARC in one deliberate way: when the list the target prefers has
    nothing evictable, eviction falls back to the other list instead of failing the store.
    """

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.target_t1 = 0.0
        self._list: dict = {}            # key -> 1 or 2, for every resident key
        self._size = [0, 0, 0]           # resident keys per list (index 1, 2)
        self._t1: OrderedDict = OrderedDict()  # evictable keys of T1, LRU first
        self._t2: OrderedDict = OrderedDict()
        self._b1: OrderedDict = OrderedDict()  # ghosts: recently evicted from T1
        self._b2: OrderedDict = OrderedDict()

    def inserted(self, key):
        if key in self._b1:
            self.target_t1 = min(self.capacity, self.target_t1 + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            where = 2
        elif key in self._b2:
            self.target_t1 = max(0.0, self.target_t1 - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
            where = 2
        else:
            where = 1
        self._list[key] = where
        self._size[where] += 1

    def set_evictable(self, key, evictable):
        lst = self._t1 if self._list[key] == 1 else self._t2
        if evictable:
            lst[key] = None
        else:
            lst.pop(key, None)

    def removed(self, key):
        where = self._list.pop(key, None)
        if where is not None:
            self._size[where] -= 1
            (self._t1 if where == 1 else self._t2).pop(key, None)

    def demote(self, key):
        (self._t1 if self._list[key] == 1 else self._t2).move_to_end(key, last=False)

    def touch(self, keys):
        if len(keys) == 1:                 # hot path: one key, usually already in T2
            key = keys[0]
            if self._list.get(key) == 2:
                try:  # noqa: SIM105 - suppress() would add a context manager to the hot path
                    self._t2.move_to_end(key)
                except KeyError:  # pinned keys are not in the evictable order
                    pass
                return
        lst, t1, t2, size = self._list, self._t1, self._t2, self._size
        for key in reversed(keys):
            where = lst.get(key)
            if where == 1:
                lst[key] = 2
                size[1] -= 1
                size[2] += 1
                if t1.pop(key, 0) is None:
                    t2[key] = None
            elif where == 2 and key in t2:
                t2.move_to_end(key)

    def _forget(self, key) -> None:
        """Move an evicted key to its ghost list."""
        if self._list.pop(key) == 1:
            self._size[1] -= 1
            del self._t1[key]
            self._b1[key] = None
            ghosts = self._b1
        else:
            self._size[2] -= 1
            del self._t2[key]
            self._b2[key] = None
            ghosts = self._b2
        if len(ghosts) > self.capacity:
            ghosts.popitem(last=False)

    def evict(self, n, protected):
        if n == 1:  # the common case, without the bookkeeping of a multi-victim plan
            prefer_t1 = self._size[1] >= max(1.0, self.target_t1)
            first, second = (self._t1, self._t2) if prefer_t1 else (self._t2, self._t1)
            for lst in (first, second):
                for key in lst:
                    if key not in protected:
                        self._forget(key)
                        return [key]
            return None
        if n <= 0:
            return []
        if len(self._t1) + len(self._t2) < n:
            return None
        it1, it2 = iter(self._t1), iter(self._t2)
        t1_size = self._size[1]
        victims: list = []
        while len(victims) < n:
            first, second = (it1, it2) if t1_size >= max(1.0, self.target_t1) else (it2, it1)
            got: list = []
            _take(first, protected, 1, got)
            if not got:
                _take(second, protected, 1, got)
                if not got:
                    return None
            key = got[0]
            if self._list[key] == 1:
                t1_size -= 1
            victims.append(key)
        for key in victims:
            self._forget(key)
        return victims

    def evictable_count(self):
        return len(self._t1) + len(self._t2)

    def is_evictable(self, key):
        return key in self._t1 or key in self._t2

    def clear(self):
        self.__init__(self.capacity)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        return POLICIES[name](capacity)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {sorted(POLICIES)}") from None
