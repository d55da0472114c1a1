"""Where stores enter RAM's eviction order: the shadows' hit rule and the adaptive choice."""

import pytest

from hybridkv.core.errors import HybridKVError
from hybridkv.core.insertion import Insertion, check_mode
from hybridkv.core.retention import Retention
from hybridkv.core.shadow import ShadowCache

B = 16


def session(s: int, blocks: int) -> list[bytes]:
    return [f"s{s}-b{i}".encode() for i in range(blocks)]


def serve(ins: Insertion, keys: list[bytes], hit_tokens: int = 0, retention: Retention | None = None):
    """One request over ``keys`` (a prompt one token past its last full block), begun and
    finished as the connector does."""
    n_tokens = len(keys) * B + 1
    ticket = ins.begin(keys, n_tokens, hit_tokens)
    ins.finished(keys, n_tokens, ticket, retention or Retention(B, 0, 0), None)
    return ticket


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


def test_the_shadows_replay_spare_states_only_where_the_engine_had_them():
    """Through vLLM a state exists only where a chunk ends: the shadows take the boundaries
    the connector was asked about, not every block."""
    ins = Insertion("adaptive", B, block_slots=20, state_slots=8)
    keys = session(0, 4)
    n_tokens = len(keys) * B + 1
    ins.finished(keys, n_tokens, ins.begin(keys, n_tokens, 0), Retention(B, 0, 0), None,
                 spare_boundaries=[B, 3 * B])
    assert set(ins.shadows[0].states) == {keys[0], keys[2], keys[3]}       # 4B: the kept one
    plain = Insertion("adaptive", B, block_slots=20, state_slots=8)
    plain.finished(keys, n_tokens, plain.begin(keys, n_tokens, 0), Retention(B, 0, 0), None)
    assert list(plain.shadows[0].states) == [keys[3]]


def test_a_cycle_longer_than_ram_turns_insertion_cold():
    """Six sessions revisited round-robin, RAM for four: LRU evicts each just before its reuse;
    storing cold keeps some whole, and the shadows see it."""
    ins = Insertion("adaptive", B, block_slots=16, state_slots=None)
    grown = {s: 0 for s in range(6)}
    for _ in range(12):
        for s in range(6):
            grown[s] += 1
            serve(ins, session(s, 2 + grown[s] % 2))
    assert ins.prefers_cold
    assert ins.score > 0


def test_reuse_that_fits_keeps_insertion_warm():
    """Each new session comes back once, two sessions later, and RAM holds what is stored and
    used meanwhile: LRU serves every return, while a cold store is the first page evicted
    once RAM is full."""
    ins = Insertion("adaptive", B, block_slots=30, state_slots=None)
    for t in range(200):
        serve(ins, session(t, 3))
        if t >= 2:
            serve(ins, session(t - 2, 3) + session(10_000 + t, 1))
    assert not ins.prefers_cold and ins.score < 0


def test_cold_mode_stores_cold_unless_the_request_found_half_its_prompt():
    ins = Insertion("cold", B, block_slots=16, state_slots=None)
    assert ins.shadows is None
    cold = sum(serve(ins, session(s, 4)).cold for s in range(3200))
    assert 3200 - 180 < cold < 3200 - 40                 # about one in WARM_EVERY drawn warm
    assert not any(serve(ins, session(0, 4), hit_tokens=3 * B).cold for _ in range(100))
    assert sum(serve(ins, session(0, 4), hit_tokens=B).cold for _ in range(100)) > 80


def test_the_warm_turns_are_drawn_so_every_user_of_a_cycle_gets_some():
    """Users taking turns in a cycle of 64: a count of one in 32 would give the warm turn to the
    same two users for ever; a draw gives it to every one of them in time."""
    ins = Insertion("cold", B, block_slots=16, state_slots=None)
    warm_users = {user for turn in range(64 * 400) if not serve(ins, session(user := turn % 64, 2)).cold}
    assert len(warm_users) == 64


def test_a_ticket_from_another_insertion_teaches_nothing():
    """A request begun before a reset or re-plan finishes into the insertion that replaced its
    issuer: its hits were measured against shadows that are gone."""
    old = Insertion("adaptive", B, block_slots=16, state_slots=None)
    new = Insertion("adaptive", B, block_slots=16, state_slots=None, score=old.score)
    keys = session(0, 3)
    new.finished(keys, len(keys) * B + 1, old.begin(keys, len(keys) * B + 1, 0), Retention(B, 0, 0), None)
    assert not new.shadows[0].blocks and new.score == 0


def test_what_a_capped_request_could_not_store_is_not_replayed():
    ins = Insertion("adaptive", B, block_slots=16, state_slots=None)
    keys = session(0, 4)
    ticket = ins.begin(keys, 4 * B + 1, 0)
    ins.finished(keys, 4 * B + 1, ticket, Retention(B, 0, 0), None, stored_tokens=2 * B)
    assert list(ins.shadows[0].blocks) == keys[:2]


def test_warm_mode_keeps_no_shadows_and_never_stores_cold():
    ins = Insertion("warm", B, block_slots=4, state_slots=4)
    assert ins.shadows is None
    assert not any(serve(ins, session(s % 7, 3)).cold for s in range(100))


def test_an_unknown_mode_names_the_choices():
    with pytest.raises(HybridKVError, match="adaptive .*warm .*cold"):
        check_mode("mru")
