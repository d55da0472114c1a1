from collections import Counter

import pytest

from hybridkv.core.layout import layout_from_dict
from hybridkv.tools.simulator import WORKLOADS, shared_system_prompt, simulate

B = 256
LAYOUT = layout_from_dict({"model": "sim", "block_tokens": B, "max_model_len": 1 << 20, "groups": [
    {"id": 0, "kind": "attention", "page_bytes": 1000}, {"id": 1, "kind": "state", "page_bytes": 5000}]})
HUGE = 1 << 40


def _system_prompt_expectation(dense: bool) -> int:
    """Unbounded RAM: request k (0-based) of a system prompt restores its full shared blocks
    from k = 1 with dense states; with semantic retention from k = 2 (the junction the second
    request stored), or from k = 1 when the first request's replay boundary was the shared one."""
    seen, first_len, saved = Counter(), {}, 0
    for tokens in shared_system_prompt():
        which = next(i for i, s in enumerate(_systems()) if tokens[: len(s)] == s)
        shared = len(_systems()[which]) // B * B
        k = seen[which]
        seen[which] += 1
        first_len.setdefault(which, len(tokens))
        first_replay = (first_len[which] - 1) // B * B
        if k >= 2 or (k == 1 and (dense or first_replay == shared)):
            saved += shared
    return saved


def _systems():
    from hybridkv.tools.simulator import _Tokens

    t = _Tokens(1)
    return [t(3000, 6000) for _ in range(3)]


def test_dense_states_hit_from_the_second_request():
    result = simulate(LAYOUT, "shared_system_prompt", HUGE, retention=None)
    assert result.prefill_tokens_saved == _system_prompt_expectation(dense=True)


def test_semantic_retention_hits_through_the_junction_from_the_third_request():
    result = simulate(LAYOUT, "shared_system_prompt", HUGE, retention=0)
    assert result.prefill_tokens_saved == _system_prompt_expectation(dense=False)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_accounting_and_budget_monotonicity(workload):
    rates = []
    for mib in (1, 4, 64):
        r = simulate(LAYOUT, workload, mib * 1024**2, retention=0, eviction="lru", reference_tokens=8192)
        assert 0 <= r.prefill_tokens_saved <= r.prompt_tokens
        assert r.ram_bytes_stored > 0 and r.requests > 0
        rates.append(r.token_hit_rate)
    assert rates[-1] >= rates[0] and rates[-1] > 0.3


def test_sparse_retention_beats_dense_when_states_are_large():
    big_states = layout_from_dict({**LAYOUT.to_dict(), "groups": [
        {"id": 0, "kind": "attention", "page_bytes": 6_291_456},
        {"id": 1, "kind": "state", "page_bytes": 77_856_768}]})
    dense = simulate(big_states, "multi_turn_chat", 16 * 1024**3, retention=None, reference_tokens=8192)
    semantic = simulate(big_states, "multi_turn_chat", 16 * 1024**3, retention=0, reference_tokens=8192)
    assert semantic.token_hit_rate > 2 * dense.token_hit_rate
