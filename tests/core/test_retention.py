import pytest

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import Group
from hybridkv.core.retention import DivergenceAlignment, Retention, compute_hit, replay_boundary

B = 64
ATT = Group(0, "attention", 100)
STATE = Group(1, "state", 1000)
SW = Group(2, "sliding_window", 100, window_tokens=128)
SCRATCH = Group(3, "scratch", 10)


def oracle(present: dict[int, set[int]]):
    return lambda gid, block: block in present.get(gid, set())


def test_replay_boundary():
    assert replay_boundary(1000, 64) == 960
    assert replay_boundary(1025, 64) == 1024
    assert replay_boundary(1024, 64) == 960     # the last token is always recomputed
    assert replay_boundary(10, 64) == 0


def kept(r: Retention, n: int, junction: int | None = None) -> list[int]:
    return [b for b in range(0, n + B, B) if r.keeps(b, n, junction)]


def test_kept_boundaries_per_policy():
    assert kept(Retention(B, None), 300) == [64, 128, 192, 256]
    assert kept(Retention(B, 0), 300) == [256]
    assert kept(Retention(B, 0), 300, junction=128) == [128, 256]
    assert kept(Retention(B, 128), 300) == [128, 256]
    assert kept(Retention(B, 128), 400, junction=64) == [64, 128, 256, 384]
    assert kept(Retention(B, 0), 40) == []
    assert kept(Retention(B, 0), 300, junction=100) == [256]      # not a boundary: ignored


def test_long_prompt_periodic():
    r, n = Retention(64, 64 * 1024), 10_000_000
    assert r.keeps(65536, n) and not r.keeps(65536 + 64, n) and not r.keeps(65536 - 64, n)
    assert r.keeps(replay_boundary(n, 64), n) and not r.keeps(replay_boundary(n, 64) + 64, n)


def test_interval_must_be_a_block_multiple():
    with pytest.raises(HybridKVError, match="not a multiple"):
        Retention(64, 100)


def test_states_per_prompt_matches_design():
    assert Retention(784, 0).states_per_prompt(65536) == 1
    assert Retention(784, 6272).states_per_prompt(65536) == 11
    assert Retention(784, None).states_per_prompt(65536) == 83


def test_attention_only_hit():
    hit = compute_hit([ATT], 64 * 5 + 10, B, oracle({0: {0, 1, 2, 4}}))
    assert hit.tokens == 192 and hit.junction is None


def test_state_only_hit_uses_exact_boundary():
    hit = compute_hit([STATE], 64 * 5 + 10, B, oracle({1: {1, 3}}))
    assert hit.tokens == 256                  # state at boundary 256 = key of block 3


def test_missing_state_at_deepest_boundary_drops_hit_and_records_junction():
    present = oracle({0: set(range(6)), 1: {2}})   # attention to 384, state only at 192
    hit = compute_hit([ATT, STATE], 64 * 6 + 1, B, present)
    assert hit.tokens == 192 and hit.attention_tokens == 384 and hit.junction == 384


def test_no_state_means_no_hit():
    hit = compute_hit([ATT, STATE], 1000, B, oracle({0: set(range(20))}))
    assert hit.tokens == 0 and hit.junction == hit.attention_tokens == 960


def test_hit_is_capped_at_replay_boundary():
    present = oracle({0: set(range(10)), 1: set(range(10))})
    hit = compute_hit([ATT, STATE], 4 * 64, B, present)   # 256 tokens: last block recomputed
    assert hit.tokens == 192 and hit.junction is None


def test_sliding_window_needs_its_tail_only():
    # window 128 = 2 blocks: blocks 3,4 present -> boundary 320 works without blocks 0..2
    hit = compute_hit([SW], 64 * 6, B, oracle({2: {3, 4}}))
    assert hit.tokens == 320
    hit = compute_hit([SW], 64 * 6, B, oracle({2: {1, 2, 4}}))
    assert hit.tokens == 192


def test_fixed_point_across_window_and_state():
    present = oracle({0: set(range(8)), 1: {3, 6}, 2: {2, 3, 5, 6}})
    hit = compute_hit([ATT, STATE, SW, SCRATCH], 64 * 8 + 1, B, present)
    # state at 448 (block 6) needs window blocks 5,6: ok -> 448
    assert hit.tokens == 448
    present = oracle({0: set(range(8)), 1: {3, 6}, 2: {2, 3, 6}})
    hit = compute_hit([ATT, STATE, SW], 64 * 8 + 1, B, present)
    assert hit.tokens == 256 and hit.attention_tokens == 256 and hit.junction is None


def test_scratch_groups_never_constrain():
    hit = compute_hit([ATT, SCRATCH], 64 * 3, B, oracle({0: {0, 1, 2}}))
    assert hit.tokens == 128


def test_tail_keeps_the_states_just_before_the_replay_boundary():
    assert kept(Retention(B, 0, tail=1), 300) == [192, 256]
    assert kept(Retention(B, 0, tail=2), 300, junction=64) == [64, 128, 192, 256]
    assert kept(Retention(B, 256, tail=1), 1000) == [256, 512, 768, 896, 960]
    assert Retention(B, 0, tail=1).states_per_prompt(300) == 2
    assert Retention(B, 0, tail=3).states_per_prompt(130) == 2    # only two boundaries exist


def test_aligned_prompt_state_sits_on_the_deepest_multiple_up_to_the_replay_boundary():
    r = Retention(B, 0, align=128)
    assert r.prompt_state(300) == 256 and kept(r, 300) == [256]
    assert r.prompt_state(350) == 256 and kept(r, 350) == [256]         # replay 320 is no multiple of 128
    assert kept(r, 350, junction=320) == [256, 320]
    assert kept(r, 100) == [] and r.states_per_prompt(100) == 0         # replay 64 < 128: no own state
    assert kept(Retention(B, 0, tail=1, align=128), 350) == [192, 256]  # the tail counts back from it
    assert kept(Retention(B, 256, align=128), 600) == [256, 512]        # periodic and aligned coincide
    assert Retention(B, 256, align=128).states_per_prompt(600) == 2
    assert Retention(B, 256, align=128).states_per_prompt(900) == 4     # 256, 512, 768 and its own at 896
    with pytest.raises(HybridKVError, match="alignment 100 is not a multiple"):
        Retention(B, 0, align=100)


def test_alignment_is_learned_from_where_prompts_diverge():
    learner = DivergenceAlignment(B, min_samples=10, min_distinct=3)
    changed = [learner.observe(512 * k, 10_000) for k in range(1, 10)]
    assert learner.align == B and not any(changed)            # too few points seen yet
    assert learner.observe(512 * 3, 10_000) and learner.align == 512
    learner.observe(0, 10_000)                                # nothing matched: no point
    assert learner.seen == 10
    learner.observe(9984, 9984)          # all it may restore matched: it resumes at its replay boundary
    assert learner.seen == 11 and learner.align == 512        # 9984 = 19.5 x 512: 1 in 11 off the grid
    assert learner.observe(5 * B, 10_000) and learner.align == B     # 2 in 12: falls back


def test_one_shared_preamble_teaches_no_alignment():
    learner = DivergenceAlignment(B, min_samples=10)
    for _ in range(100):
        learner.observe(96 * B, 10_000)                       # every prompt leaves one system prompt
    assert learner.align == B


def test_learned_alignment_has_hysteresis_and_follows_the_traffic():
    learner = DivergenceAlignment(B, min_samples=20, window=400)
    for k in range(1, 100):
        learner.observe(512 * k, 100_000)
    assert learner.align == 512
    flips = 0
    for k in range(1, 200):          # 7% off the grid: under the 95% to switch up, over the 90% to stay
        flips += learner.observe((2 * k + 1) * B if k % 14 == 0 else 512 * k, 100_000)
    assert learner.align == 512 and flips == 0
    for k in range(1, 400):                                   # the traffic changes: arbitrary blocks
        learner.observe(k * B, 100_000)
    assert learner.align == B
    top = DivergenceAlignment(B, max_blocks=4, min_samples=1, min_distinct=1)
    assert top.observe(B * 64, 10**6) and top.align == 4 * B    # never past max_blocks
