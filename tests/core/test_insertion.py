"""Where stores enter RAM's eviction order: the adaptive choice between warm and cold."""

import pytest

from hybridkv.core.errors import HybridKVError
from hybridkv.core.insertion import Insertion, check_mode
from hybridkv.core.retention import Retention

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
