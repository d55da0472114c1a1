"""Key-only replicas of RAM: the hybrid hit rule, LRU order, cold and spare stores, and a
shared budget's bytes."""

from hybridkv.core.shadow import ShadowCache, SharedShadowCache


def session(s: int, blocks: int) -> list[bytes]:
    return [f"s{s}-b{i}".encode() for i in range(blocks)]


def test_the_shadow_hit_ends_where_a_state_is_kept():
    shadow = ShadowCache(block_slots=10, state_slots=10)
    keys = session(0, 4)
    shadow.record(keys, 0, [2, 4], cold=False)           # states after blocks 2 and 4
    assert shadow.hit_blocks(keys, 4) == 4
    assert shadow.hit_blocks(keys, 3) == 2               # the replay boundary stops it before 4
    assert shadow.hit_blocks(session(1, 4), 4) == 0
    shadow.blocks.pop(keys[2])
    assert shadow.hit_blocks(keys, 4) == 2               # no block past a missing one


def test_a_hit_evicted_from_the_shadow_before_its_request_finished_is_stored_again():
    """Requests overlap in an engine: others may evict what one hit between its begin and its
    finish (or a reset may replace the shadows)."""
    shadow = ShadowCache(block_slots=3, state_slots=3)
    keys = session(0, 3)
    shadow.record(keys, 0, [3], cold=False)
    hit = shadow.hit_blocks(keys, 3)
    shadow.record(session(1, 3), 0, [3], cold=False)      # evicts the first session's pages
    shadow.record(keys, hit, [], cold=False)
    assert list(shadow.blocks) == keys and keys[2] in shadow.states


def test_a_shadow_without_states_hits_every_present_block():
    shadow = ShadowCache(block_slots=10, state_slots=None)
    keys = session(0, 3)
    shadow.record(keys, 0, [], cold=False)
    assert shadow.hit_blocks(keys + session(1, 1), 4) == 3


def test_a_shadow_holds_no_more_than_its_slots_and_cold_keys_leave_first():
    shadow = ShadowCache(block_slots=5, state_slots=None)
    shadow.record(session(0, 3), 0, [], cold=False)
    shadow.record(session(1, 2), 0, [], cold=True)       # room left: stored, at the evicted-first end
    assert list(shadow.blocks)[:2] == session(1, 2)[::-1]
    shadow.record(session(2, 2), 0, [], cold=False)
    assert len(shadow.blocks) == 5 and not any(k in shadow.blocks for k in session(1, 2))
    assert all(k in shadow.blocks for k in session(0, 3))


def test_a_resized_shadow_keeps_its_keys_and_sheds_the_ones_lru_evicts_first():
    """RAM re-planned without losing its pages: the shadow keeps what it held, at new sizes."""
    shadow = ShadowCache(block_slots=6, state_slots=3)
    for s in range(3):
        shadow.record(session(s, 2), 0, [2], cold=False)
    shadow.resize(block_slots=8, state_slots=2)          # more blocks, fewer states
    assert list(shadow.blocks) == [k for s in range(3) for k in session(s, 2)]
    assert list(shadow.states) == [session(1, 2)[1], session(2, 2)[1]]     # the oldest state left
    shadow.resize(block_slots=3, state_slots=2)
    assert list(shadow.blocks) == [session(1, 2)[1], *session(2, 2)]
    assert shadow.hit_blocks(session(2, 2), 2) == 2 and shadow.hit_blocks(session(0, 2), 2) == 0
    shadow.record(session(3, 2), 0, [], cold=False)      # and holds no more than the new sizes
    assert len(shadow.blocks) == 3
    attention_only = ShadowCache(block_slots=4, state_slots=None)
    attention_only.record(session(0, 4), 0, [], cold=False)
    attention_only.resize(block_slots=2, state_slots=None)
    assert list(attention_only.blocks) == session(0, 4)[2:]


def test_spare_states_enter_a_shadow_only_into_free_room_and_cold():
    """As the cache stores them: a shadow replays spare states where it has room for them, at
    the evicted-first end, and never evicts a kept state for one."""
    shadow = ShadowCache(block_slots=20, state_slots=3)
    first = session(0, 4)
    shadow.record(first, 0, [4], cold=False, spare_ends=[1, 2, 3])
    assert list(shadow.states) == [first[1], first[0], first[3]]   # two spares fit, cold
    assert shadow.hit_blocks(first[:2] + session(9, 2), 4) == 2    # a branch after block 2 hits
    second = session(1, 2)
    shadow.record(second, 0, [2], cold=False, spare_ends=[1])      # full: the kept state evicts a spare
    assert second[1] in shadow.states and second[0] not in shadow.states and first[3] in shadow.states


def test_a_shared_shadow_evicts_the_oldest_pages_of_either_kind_to_fit_its_bytes():
    """One budget: a state (four blocks' bytes here) is paid for by the oldest blocks, and
    blocks by the oldest state."""
    shadow = SharedShadowCache(budget_bytes=12, block_bytes=1, state_bytes=4)
    old = session(0, 4)
    shadow.record(old, 0, [4], cold=False)                # 4 blocks + 1 state = 8 bytes
    new = session(1, 2)
    shadow.record(new, 0, [2], cold=False)                # 6 more: the oldest two blocks go
    assert shadow.used == 12
    assert [shadow.has_block(k) for k in old] == [False, False, True, True] and shadow.has_state(old[3])
    assert shadow.hit_blocks(old, 4) == 0                  # a hit needs every block before the state
    shadow.record(session(2, 4), 0, [], cold=False)       # four blocks: the oldest pages go, its state too
    assert not shadow.has_state(old[3]) and shadow.has_state(new[1]) and shadow.used <= 12


def test_a_shared_shadow_hits_as_the_split_one_does():
    keys = session(0, 4)
    split, shared = ShadowCache(10, 10), SharedShadowCache(100, 1, 4)
    for shadow in (split, shared):
        shadow.record(keys, 0, [2, 4], cold=False)
    for limit in range(5):
        assert split.hit_blocks(keys, limit) == shared.hit_blocks(keys, limit)
    assert shared.hit_blocks(session(1, 4), 4) == 0


def test_a_cold_store_into_a_full_shared_shadow_leaves_first_and_spares_need_room():
    shadow = SharedShadowCache(budget_bytes=10, block_bytes=1, state_bytes=4)
    warm = session(0, 6)
    shadow.record(warm, 0, [6], cold=False)                # full: 6 + 4
    shadow.record(session(1, 1), 0, [1], cold=True)        # cold: itself evicted, nothing else
    assert all(shadow.has_block(k) for k in warm) and shadow.has_state(warm[5]) and shadow.used == 10
    assert not shadow.state_room()
    shadow.record(warm, 6, [], cold=False, spare_ends=[2, 4])   # no room: no spare stored
    assert not shadow.has_state(warm[1]) and not shadow.has_state(warm[3])
