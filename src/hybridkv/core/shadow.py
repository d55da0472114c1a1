"""Key-only replicas of RAM, for measuring a choice while serving.

A shadow holds the keys RAM's pools would hold, no bytes, in LRU order. Two shadows fed the
same requests under two settings (where new pages enter, which states are kept) tell which
setting restores more on the traffic at hand; ``Insertion`` and ``PeriodicChoice`` each run a
pair. ``ShadowCache`` mirrors RAM split statically (a slot count per kind); ``SharedShadowCache``
the shared arena, approximated without its segments by one byte budget in one LRU order over
attention blocks and states.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Sequence

from hybridkv.core.retention import Retention, replay_boundary


def pair_hits(shadows: tuple[Shadow, Shadow], keys: Sequence[bytes], n_tokens: int,
              block_tokens: int) -> tuple[int, int]:
    """Blocks each shadow of a pair restores for a prompt, up to its replay boundary."""
    limit = min(len(keys), replay_boundary(n_tokens, block_tokens) // block_tokens)
    first, second = shadows
    return first.hit_blocks(keys, limit), second.hit_blocks(keys, limit)


def stores(keys: Sequence[bytes], n_tokens: int, block_tokens: int, lowest_hit: int, retention: Retention,
           junction: int | None, stored_tokens: int | None = None,
           engine_states: Collection[int] = ()) -> tuple[Sequence[bytes], list[int], list[int]]:
    """What a finished request leaves in a shadow that restored ``lowest_hit`` blocks or more:
    its full blocks (up to ``stored_tokens`` where the engine capped its stores), the block
    counts at whose end ``retention`` keeps a state, and those where the engine had a state
    (``engine_states``, in tokens) the retention does not keep: spare states."""
    B = block_tokens
    end = n_tokens if stored_tokens is None else min(n_tokens, stored_tokens)
    boundaries = range(B * (lowest_hit + 1), end + 1, B)
    ends = [b // B for b in boundaries if retention.keeps(b, n_tokens, junction)]
    spares = sorted({b // B for b in engine_states if b in boundaries and not retention.keeps(b, n_tokens, junction)})
    return keys[:end // B], ends, spares


class Shadow(ABC):
    """What a request restores from RAM's keys, and what it leaves there."""

    has_states: bool

    @abstractmethod
    def has_block(self, key: bytes) -> bool: ...
    @abstractmethod
    def has_state(self, key: bytes) -> bool: ...
    @abstractmethod
    def state_room(self) -> bool: ...
    @abstractmethod
    def use(self, key: bytes, state: bool) -> None:
        """A hit used the page: most recent, stored again if evicted since."""
    @abstractmethod
    def add(self, key: bytes, state: bool, cold: bool) -> None:
        """A store: at the warm end, or at the cold end; nothing where the key is present."""

    def hit_blocks(self, keys: Sequence[bytes], limit: int) -> int:
        """Leading blocks the hybrid hit restores: present blocks up to the deepest one at whose
        end a state is kept (any present block without states), at most ``limit``."""
        has_block, has_state, states, best = self.has_block, self.has_state, self.has_states, 0
        for i in range(limit):
            if not has_block(keys[i]):
                break
            if not states or has_state(keys[i]):
                best = i + 1
        return best

    def record(self, keys: Sequence[bytes], hit: int, state_ends: Sequence[int], cold: bool,
               spare_ends: Sequence[int] = ()) -> None:
        """A request restored ``hit`` blocks and stored its other blocks and the states ending
        at ``state_ends`` (block counts); ``cold`` stores them at the cold end. What it hit is
        made most recent, stored again if other requests evicted it since it began. States at
        ``spare_ends`` are stored as the cache stores spare states: cold, into free room only.
        ``keys`` may end before ``hit`` (a request whose stores were capped below its hit)."""
        hit = min(hit, len(keys))
        for key in keys[:hit]:
            self.use(key, False)
        if hit and self.has_states:
            self.use(keys[hit - 1], True)
        for key in keys[hit:]:
            self.add(key, False, cold)
        if self.has_states:
            for end in state_ends:
                if end > hit:
                    self.add(keys[end - 1], True, cold)
            for end in spare_ends:
                if not self.state_room():
                    break
                if end > hit:
                    self.add(keys[end - 1], True, True)


class ShadowCache(Shadow):
    """RAM split statically: attention blocks and kept states, each in its own LRU order
    bounded by the slots its pools have (``state_slots`` None: a model without recurrent state)."""

    def __init__(self, block_slots: int, state_slots: int | None):
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.states: OrderedDict[bytes, None] | None = None if state_slots is None else OrderedDict()
        self.block_slots, self.state_slots = block_slots, state_slots
        self.has_states = state_slots is not None

    def has_block(self, key: bytes) -> bool:
        return key in self.blocks

    def has_state(self, key: bytes) -> bool:
        return key in self.states

    def state_room(self) -> bool:
        return len(self.states) < self.state_slots

    def resize(self, block_slots: int, state_slots: int | None) -> None:
        """New sizes; where smaller, the keys LRU evicts first leave."""
        self.block_slots, self.state_slots = block_slots, state_slots
        for order, slots in ((self.blocks, block_slots), (self.states, state_slots)):
            while order is not None and len(order) > slots:
                order.popitem(last=False)

    def use(self, key: bytes, state: bool) -> None:
        order = self.states if state else self.blocks
        self._put(order, self.state_slots if state else self.block_slots, key, False)
        order.move_to_end(key)

    def add(self, key: bytes, state: bool, cold: bool) -> None:
        if state:
            self._put(self.states, self.state_slots, key, cold)
        else:
            self._put(self.blocks, self.block_slots, key, cold)

    @staticmethod
    def _put(order: OrderedDict, slots: int, key: bytes, cold: bool) -> None:
        """A cold key stored into a full shadow leaves at once; a pool keeps it at the front
        until its next store, which the request's own next page usually is."""
        if key in order:
            return
        order[key] = None
        if cold:
            order.move_to_end(key, last=False)
        if len(order) > slots:
            order.popitem(last=False)


class SharedShadowCache(Shadow):
    """RAM as one arena, without its segments: attention blocks (``block_bytes`` each) and
    states (``state_bytes`` each, every state group together) in one LRU order within
    ``budget_bytes``."""

    has_states = True

    def __init__(self, budget_bytes: int, block_bytes: int, state_bytes: int):
        self.order: OrderedDict[bytes | tuple[bytes], None] = OrderedDict()   # a state's key is (key,)
        self.budget, self.block_bytes, self.state_bytes = budget_bytes, block_bytes, state_bytes
        self.used = 0

    def has_block(self, key: bytes) -> bool:
        return key in self.order

    def has_state(self, key: bytes) -> bool:
        return (key,) in self.order

    def state_room(self) -> bool:
        return self.used + self.state_bytes <= self.budget

    def use(self, key: bytes, state: bool) -> None:
        entry = (key,) if state else key
        if entry in self.order:
            self.order.move_to_end(entry)
        else:
            self._store(entry, state, False)

    def add(self, key: bytes, state: bool, cold: bool) -> None:
        entry = (key,) if state else key
        if entry not in self.order:
            self._store(entry, state, cold)

    def _store(self, entry: bytes | tuple[bytes], state: bool, cold: bool) -> None:
        """Evicts from the cold end until the budget holds (a cold entry into a full shadow
        is the first to go, as in ``ShadowCache``)."""
        order = self.order
        order[entry] = None
        if cold:
            order.move_to_end(entry, last=False)
        self.used += self.state_bytes if state else self.block_bytes
        while self.used > self.budget and order:
            gone, _ = order.popitem(last=False)
            self.used -= self.state_bytes if type(gone) is tuple else self.block_bytes
