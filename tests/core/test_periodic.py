"""Whether periodic states pay for their bytes: two shadows, with and without them, decide."""

from hybridkv.core.periodic import PeriodicChoice
from hybridkv.core.retention import Retention
from hybridkv.core.shadow import ShadowCache, SharedShadowCache

B = 16
EVERY = 4 * B        # a periodic state every four blocks


def blocks(*parts: tuple[str, int]) -> list[bytes]:
    """Keys of a prompt made of labelled runs of blocks; a key names its whole prefix, as
    block hashes do."""
    labels = [f"{name}{i}" for name, n in parts for i in range(n)]
    return ["/".join(labels[:i + 1]).encode() for i in range(len(labels))]


def serve(choice: PeriodicChoice, keys: list[bytes], spare_boundaries=None) -> tuple[int, int]:
    """One request over ``keys`` (one token past its last full block), begun and finished as
    the connector does, under the retention the choice has in force."""
    n_tokens = len(keys) * B + 1
    hits = choice.begin(keys, n_tokens)
    choice.finished(keys, n_tokens, hits, Retention(B, choice.interval_now), None, cold=False,
                    spare_boundaries=spare_boundaries)
    return hits


def test_branches_inside_earlier_turns_keep_periodic_states():
    """Each document is asked about, then asked again from a point inside it: only a periodic
    state lies there."""
    choice = PeriodicChoice(B, EVERY, (ShadowCache(1000, 1000), ShadowCache(1000, 1000)))
    for doc in range(20):
        serve(choice, blocks((f"d{doc}-", 12)))
        with_them, without = serve(choice, blocks((f"d{doc}-", 6), (f"q{doc}-", 6)))
        assert (with_them, without) == (4, 0)
    assert choice.keeps_periodic and choice.interval_now == EVERY and choice.score < 0


def test_sessions_that_extend_at_their_ends_drop_periodic_states_when_their_bytes_evict_history():
    """Four chats take turns, each turn extending the last; a state costs eight blocks. Without
    periodic states the four histories and their last states fit; with them, the extra states
    push the oldest pages out before their session's next turn."""
    def shadow():
        return SharedShadowCache(budget_bytes=110, block_bytes=1, state_bytes=8)

    choice = PeriodicChoice(B, EVERY, (shadow(), shadow()))
    history = {s: 0 for s in range(4)}
    for _ in range(6):
        for s in history:
            history[s] += 3
            serve(choice, blocks((f"s{s}-", history[s])))
    assert not choice.keeps_periodic and choice.interval_now == 0 and choice.score > 0


def test_the_shadows_differ_only_in_the_periodic_states():
    choice = PeriodicChoice(B, EVERY, (ShadowCache(100, 100), ShadowCache(100, 100)))
    keys = blocks(("a", 10))
    serve(choice, keys)
    with_them, without = choice.shadows
    assert list(with_them.blocks) == list(without.blocks) == keys
    assert set(with_them.states) == {keys[3], keys[7], keys[9]} and set(without.states) == {keys[9]}


def test_the_shadow_without_them_replays_the_periodic_boundaries_as_spare_states():
    """Where spare states are on, a state the engine had at a periodic boundary still enters
    the shadow that does not keep it: into free room, cold."""
    choice = PeriodicChoice(B, EVERY, (ShadowCache(100, 100), ShadowCache(100, 100)))
    keys = blocks(("a", 10))
    serve(choice, keys, spare_boundaries=[2 * B])
    with_them, without = choice.shadows
    assert set(with_them.states) == {keys[1], keys[3], keys[7], keys[9]}
    assert set(without.states) == {keys[1], keys[3], keys[7], keys[9]}
    assert list(without.states)[-1] == keys[9]        # the kept one warm, the spares cold


def test_paused_periodic_states_still_enter_the_shadow_that_keeps_them():
    """While the retention in force has no periodic states, the engine's state at a periodic
    boundary reaches the connector as a spare: the shadow with them keeps it, warm; the one
    without stores it as a spare, cold."""
    choice = PeriodicChoice(B, EVERY, (ShadowCache(100, 100), ShadowCache(100, 100)), score=1.0)
    assert choice.interval_now == 0
    keys = blocks(("a", 10))
    serve(choice, keys, spare_boundaries=[4 * B, 8 * B])
    with_them, without = choice.shadows
    assert list(with_them.states) == [keys[3], keys[7], keys[9]]
    assert list(without.states) == [keys[7], keys[3], keys[9]]      # spares at the cold end


def test_the_score_carries_over_and_decides_from_the_start():
    shadows = (ShadowCache(10, 10), ShadowCache(10, 10))
    assert not PeriodicChoice(B, EVERY, shadows, score=5.0).keeps_periodic
    assert PeriodicChoice(B, EVERY, shadows).interval_now == EVERY
