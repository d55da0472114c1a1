import json
from collections import Counter

import numpy as np
import pytest

from hybridkv.cache import TieredCache
from hybridkv.config import CacheConfig
from hybridkv.connector import Connector
from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import layout_from_dict
from hybridkv.core.retention import Retention
from hybridkv.tools.policy_compare import changed_settings, compare, table
from hybridkv.tools.simulator import Policy, PrefixTruth, policy, replay, workload_prompts
from hybridkv.tools.traces import read_trace, write_mooncake
from hybridkv.tools.workloads import WORKLOADS, agent_trace, multi_turn_trace, shared_system_prompt

from helpers.cli import assert_one_line_error, cli

B = 256
LAYOUT = layout_from_dict({"model": "sim", "block_tokens": B, "max_model_len": 1 << 20, "groups": [
    {"id": 0, "kind": "attention", "page_bytes": 1000}, {"id": 1, "kind": "state", "page_bytes": 5000}]})
HUGE = 1 << 40


def simulate(layout, workload, budget, retention=0, eviction="lru", reference_tokens=8192):
    """One synthetic workload under one retention and eviction, through the real connector."""
    pol = Policy(f"{retention}/{eviction}", retention=retention, eviction=eviction)
    return replay(layout, workload_prompts(workload), budget, pol, workload, reference_tokens)


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
    from hybridkv.tools.workloads import TokenSource

    t = TokenSource(1)
    return [t(3000, 6000) for _ in range(3)]


def test_dense_states_hit_from_the_second_request():
    result = simulate(LAYOUT, "shared_system_prompt", HUGE, retention=None)
    assert result.prefill_tokens_saved == _system_prompt_expectation(dense=True)


def test_semantic_retention_hits_through_the_junction_from_the_third_request():
    result = simulate(LAYOUT, "shared_system_prompt", HUGE, retention=0)
    assert result.prefill_tokens_saved == _system_prompt_expectation(dense=False)


def test_spare_states_hit_from_the_second_request_while_ram_has_room():
    """Semantic retention plus spare states, where RAM never fills: every block's state is
    stored into free slots, so a system prompt's second request hits as with dense states."""
    pol = Policy("spare", retention=0, spare=True)
    result = replay(LAYOUT, workload_prompts("shared_system_prompt"), HUGE, pol, "s", 8192)
    assert result.prefill_tokens_saved == _system_prompt_expectation(dense=True)
    assert result.wrong_hits == 0


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
    dense = simulate(big_states, "multi_turn_chat", 8 * 1024**3, retention=None, reference_tokens=8192)
    semantic = simulate(big_states, "multi_turn_chat", 8 * 1024**3, retention=0, reference_tokens=8192)
    assert semantic.token_hit_rate > 2 * dense.token_hit_rate


@pytest.mark.parametrize("workload, kib, split", [("multi_turn_chat", 360, "shared"), ("agentic", 600, "static")])
def test_adaptive_insertion_serves_sessions_that_cycle_past_ram(workload, kib, split):
    """Sessions taking turns in a cycle longer than RAM holds: LRU evicts each one just before
    it returns; the adaptive insertion learns to store cold and keeps part of the cycle whole.
    Where RAM holds the cycle, it changes nothing. (Agents cycle past RAM only when the split
    between attention pages and states is static.)"""
    connectors = []

    class Recording(Connector):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            connectors.append(self)

    def rate(kib, insertion):
        pol = Policy(insertion, retention=0, insertion=insertion, ram_split=split)
        result = replay(LAYOUT, workload_prompts(workload), kib * 1024, pol, workload, 8192, connector=Recording)
        assert result.wrong_hits == 0
        return result.token_hit_rate

    assert rate(kib, "adaptive") > rate(kib, "warm") + 0.25
    adaptive = connectors[0].stats
    assert adaptive["insertion_cold"] == 1 and adaptive["cold_requests"] > 0
    assert rate(2000, "adaptive") == rate(2000, "warm")
    assert connectors[2].stats["insertion_cold"] == 0


def test_the_equal_bytes_ceiling_bounds_the_learned_insertion_too():
    """Chat users taking turns at 2 GiB on the shipped layout: with states free, plain LRU
    thrashes (51.9%) where the learned insertion keeps part of the cycle; the ceiling is the
    better of the two, so no policy replayed beside it exceeds it."""
    from hybridkv.config import load_layout
    from hybridkv.tools.bench_policies import LAYOUT as SHIPPED

    layout = load_layout(SHIPPED)
    out = compare(layout, workload_prompts("multi_turn_chat"), [2 * 1024**3], "m", 2560, ["semantic"]).to_json()
    assert out["ceiling_equal_bytes"][0] > 0.6
    assert all(p["token_hit_rate"][0] <= out["ceiling_equal_bytes"][0] for p in out["policies"].values())
    assert out["ceiling_at_recommended_attention_bytes"][0] <= out["ceiling_equal_bytes"][0]


def test_one_shared_budget_restores_more_where_the_split_binds():
    """Agents at 2 GiB on the shipped layout: the static split gives states room attention
    needed; one budget in one LRU order moves it, never holding more than the budget."""
    from hybridkv.config import load_layout
    from hybridkv.tools.bench_policies import LAYOUT as SHIPPED

    layout, prompts = load_layout(SHIPPED), workload_prompts("agentic")
    split, shared = (replay(layout, prompts, 2 * 1024**3, policy("aligned-periodic"), "agentic", 8192,
                            shared_budget=s) for s in (False, True))
    assert shared.wrong_hits == 0
    assert shared.token_hit_rate > split.token_hit_rate + 0.02
    with pytest.raises(HybridKVError, match="one LRU order"):
        replay(layout, prompts[:2], 2 * 1024**3, policy("marconi"), shared_budget=True)


# -- traces, policies and the wrong-hit check ------------------------------------------------
def _trace(tmp_path, lines, name="t.jsonl"):
    path = tmp_path / name
    write_mooncake(path, lines, 512)
    return path


def _prompts(tmp_path, lines):
    return [r.tokens for r in read_trace(_trace(tmp_path, lines))]


def test_prefix_truth_counts_blocks_seen_before_up_to_the_replay_boundary():
    truth = PrefixTruth(4)
    a = np.arange(10)
    assert truth.servable_then_add(a) == 0
    assert truth.servable_then_add(np.r_[a[:8], 99, 98]) == 8
    assert truth.servable_then_add(a[:8]) == 4           # the last token is always recomputed
    assert truth.servable_then_add(np.r_[5, a[1:10]]) == 0


class _KeysIgnoreTokens(Connector):
    """A planted keying bug: every prompt is keyed as if it were all zeros."""

    def begin(self, request_id, tokens, *args, **kwargs):
        return super().begin(request_id, np.zeros_like(tokens), *args, **kwargs)


def test_a_planted_wrong_hit_is_counted(tmp_path):
    prompts = _prompts(tmp_path, list(agent_trace(sessions=4, steps=3)))
    honest = replay(LAYOUT, prompts, HUGE, policy("semantic"))
    assert honest.wrong_hits == 0 and honest.prefill_tokens_saved > 0
    planted = replay(LAYOUT, prompts, HUGE, policy("semantic"), connector=_KeysIgnoreTokens)
    assert planted.wrong_hits > 0 and planted.prefill_tokens_saved > honest.prefill_tokens_saved


def test_tail_state_serves_a_follow_up_that_changes_the_last_block(tmp_path):
    """Turn 2 re-sends turn 1's full blocks but not its partial last one: the state at the
    replay boundary lies in tokens turn 2 lacks, the tail state one block earlier serves it."""
    lines = [([1, 2, 3, 4], 3 * 512 + 400), ([1, 2, 3, 5, 6], 4 * 512 + 100)]
    prompts = _prompts(tmp_path, lines)
    semantic = replay(LAYOUT, prompts, HUGE, policy("semantic"))
    tail = replay(LAYOUT, prompts, HUGE, policy("semantic-tail"))
    assert semantic.prefill_tokens_saved == 0
    assert tail.prefill_tokens_saved == 3 * 512 == tail.servable_tokens


def test_learned_alignment_keeps_one_state_where_follow_ups_resume(tmp_path):
    """Chat sessions recorded in 512-token hash blocks (twice the layout's block): every
    follow-up leaves the cached tokens at a multiple of 512, so once the connector has seen
    that, one state a prompt at the deepest multiple serves what the replay and tail states
    served together, for half the state pages."""
    prompts = _prompts(tmp_path, list(multi_turn_trace(sessions=60, turns=5, active=12)))
    tail = replay(LAYOUT, prompts, HUGE, policy("semantic-tail"))
    aligned = replay(LAYOUT, prompts, HUGE, policy("semantic-aligned"))
    assert aligned.wrong_hits == 0 == tail.wrong_hits
    assert aligned.prefill_tokens_saved >= tail.prefill_tokens_saved > 0
    assert aligned.ram_bytes_stored < 0.9 * tail.ram_bytes_stored
    assert (aligned.state_align_tokens, tail.state_align_tokens) == (2 * B, B)


def test_compare_runs_every_policy_under_the_unlimited_ceiling(tmp_path):
    prompts = _prompts(tmp_path, list(multi_turn_trace(sessions=30, turns=4, active=8)))
    budgets = [2 * 1024**2, 8 * 1024**2, 64 * 1024**2]
    c = compare(LAYOUT, prompts, budgets, "multi_turn", reference_tokens=2048)
    out = c.to_json()
    assert set(out["policies"]) == {"dense", "vllm-align", "semantic", "semantic-tail", "periodic-4096",
                                    "periodic-16384", "semantic-aligned", "aligned-periodic-8192", "marconi",
                                    "aligned-periodic"}
    assert out["recommended"] == "aligned-periodic" and c.wrong_hits() == 0
    for rates in [p["token_hit_rate"] for p in out["policies"].values()] + [out["ceiling_equal_bytes"]]:
        assert len(rates) == 3 and all(0 <= r <= out["ceiling_unlimited"] for r in rates)
    assert out["ceiling_equal_bytes"][-1] > 0 and len(out["best"]) == 3
    assert all(0 < s < 1 for s in out["recommended_attention_share"])
    assert [changed_settings(name) for name in out["best"]] == out["best_settings"]
    assert "| best policy (settings beyond the defaults) | " in table(out)
    assert len(out["ceiling_at_recommended_attention_bytes"]) == 3
    for field in ("recommended_shared_budget", "recommended_static_split", "recommended_clairvoyant_states"):
        assert len(out[field]) == 3 and all(0 <= r <= out["ceiling_unlimited"] for r in out[field])
    assert "over one budget in one LRU order" in table(out) and "`ram_split = static`" in table(out)
    assert "storing states only where a later prompt resumes" in table(out)
    # a cache not told the prompt length plans for the model's maximum (1M here), then learns
    assert out["default_reference_tokens"] == 1 << 20
    assert len(out["recommended_at_default_reference"]) == 3
    learned = out["learned_reference_tokens"]
    assert all(t < 1 << 20 for t in learned)     # re-planned for the trace's prompts
    assert f"RAM planned for 1,048,576-token prompts, re-planned for {learned[0]:,} /" in table(out)
    learned = out["learned_state_align"]      # 30 short sessions: too few points to move off a block
    assert learned == [B] * 3 and f"prompt states at multiples of (tokens) | {B} | {B} | {B} |" in table(out)


def test_simulate_cli_compare_json_and_plot(tmp_path):
    layout = tmp_path / "layout.json"
    layout.write_text(LAYOUT.to_json())
    trace = _trace(tmp_path, list(multi_turn_trace(sessions=12, turns=3, active=4)))
    chart = tmp_path / "policies.png"
    proc = cli("simulate", "--trace", trace, "--layout", layout, "--ram-bytes", "4MiB,64MiB", "--compare",
               "--policies", "semantic,vllm-align", "--json", "--plot", chart)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["budgets"] == [4 * 1024**2, 64 * 1024**2]
    assert set(out["policies"]) == {"semantic", "vllm-align", "aligned-periodic"}
    assert chart.stat().st_size > 1000
    single = cli("simulate", "--trace", trace, "--layout", layout, "--ram-bytes", "64MiB", "--policy", "dense")
    assert single.returncode == 0 and "wrong hits 0" in single.stdout, single.stderr


def test_simulate_cli_replays_the_default_unless_told_otherwise(tmp_path):
    trace = _trace(tmp_path, list(multi_turn_trace(sessions=12, turns=3, active=4)))
    args = ("simulate", "--trace", trace, "--ram-bytes", "8GiB", "--json")
    default, custom = cli(*args), cli(*args, "--retention", "0", "--eviction", "arc")
    assert default.returncode == 0 == custom.returncode, default.stderr + custom.stderr
    assert json.loads(default.stdout)[0]["policy"] == "aligned-periodic"
    assert json.loads(cli(*args, "--retention", "auto").stdout)[0]["policy"] == "aligned-periodic"
    assert json.loads(custom.stdout)[0]["policy"] == "custom"
    warm = cli(*args, "--insertion", "warm")
    assert warm.returncode == 0 and json.loads(warm.stdout)[0]["policy"] == "custom"
    no_spares = cli(*args, "--no-spare-states")
    assert no_spares.returncode == 0 and json.loads(no_spares.stdout)[0]["policy"] == "custom"
    # branching agents at 32 GiB: the static split gives states too little room
    shared, static = (json.loads(cli("simulate", "--workload", "agent_branches", "--ram-bytes", "32GiB", "--json",
                                     *extra).stdout)[0] for extra in ((), ("--ram-split", "static")))
    assert static["policy"] == "custom" and shared["token_hit_rate"] > static["token_hit_rate"] + 0.03


def test_simulate_cli_misuse(tmp_path):
    assert_one_line_error(cli("simulate"), "either --trace PATH or --workload NAME")
    assert_one_line_error(cli("simulate", "--workload", "agentic", "--policy", "dense", "--retention", "0"),
                          "leave them out with --policy or --compare")
    assert_one_line_error(cli("simulate", "--workload", "agentic", "--compare", "--insertion", "warm"),
                          "leave them out with --policy or --compare")
    assert_one_line_error(cli("simulate", "--workload", "agentic", "--policy", "dense", "--ram-split", "static"),
                          "leave them out with --policy or --compare")
    assert_one_line_error(cli("simulate", "--workload", "nope"), "workload 'nope' is unknown")
    assert_one_line_error(cli("simulate", "--workload", "agentic", "--ram-bytes", "lots"), "--ram-bytes")
    assert_one_line_error(cli("simulate", "--workload", "agentic", "--compare", "--policies", "best"),
                          "policy 'best' is unknown")


@pytest.mark.parametrize("name", ["dense", "semantic", "semantic-tail", "semantic-aligned", "periodic-4096",
                                  "aligned-periodic-2048", "aligned-periodic"])
def test_a_policys_settings_make_a_cache_keep_what_the_policy_kept(name):
    """What the comparison tells a user to set for a policy, given to a real cache, makes its
    connector keep the same states the replay kept (and learn the alignment where it did)."""
    pol = policy(name)
    config = CacheConfig(block_tokens=B, ram_bytes=HUGE, reference_tokens=8192, **changed_settings(name))
    with TieredCache(LAYOUT, config, secondaries=[], pageless=True) as cache:
        conn = Connector(cache)
        assert conn.retention == pol.keeper(B)
        assert (conn.alignment is not None) == (pol.align is None and pol.retention is not None)
        assert conn.insertion.mode == pol.insertion and conn.spare_states == pol.spare


def test_policies_no_setting_reproduces_say_so():
    assert changed_settings("marconi") is None and changed_settings("vllm-align") is None
    assert changed_settings("aligned-periodic") == {}


def test_policy_objects_name_what_they_keep():
    assert policy("periodic-2048") == Policy("periodic-2048", retention=2048)
    both = policy("aligned-periodic-2048")          # the default's states plus one every 2048
    assert both == Policy("aligned-periodic-2048", retention=2048, tail=1, align=None)
    keeper = both.keeper(256)
    assert keeper.keeps(2048, 5000) and keeper.keeps(4608, 5000) and not keeper.keeps(3072, 5000)
    default = policy("aligned-periodic")           # hybridkv's default: about 16K tokens on any block
    assert default.interval(256) == 16384 and default.interval(544) == 30 * 544
    assert default.keeper(256) == Retention(256, 16384, tail=1)
    for bad in ("aligned-periodic-", "aligned-periodic-0", "periodic-x"):
        with pytest.raises(HybridKVError, match="unknown"):
            policy(bad)
    assert not policy("vllm-align").keeper(256).keeps(256, 2000, junction=256)
    assert policy("semantic").keeper(256).keeps(256, 2000, junction=256)


@pytest.mark.parametrize("workload", ["multi_turn_chat", "shared_system_prompt", "agentic"])
def test_clairvoyant_states_serve_every_repeated_prefix_where_nothing_is_evicted(workload):
    """Storing a state exactly where a later prompt resumes, and no other: with room for
    everything, every prompt restores all it shares with the ones before it, from fewer
    states than the default stores."""
    from hybridkv.tools.simulator import RECOMMENDED, clairvoyant_states

    prompts = workload_prompts(workload)
    default = replay(LAYOUT, prompts, HUGE, policy(RECOMMENDED), workload)
    seer = replay(LAYOUT, prompts, HUGE, policy(RECOMMENDED), workload,
                  connector=clairvoyant_states(prompts, B))
    assert seer.wrong_hits == 0
    assert seer.prefill_tokens_saved == seer.servable_tokens > 0
    assert seer.ram_bytes_stored < default.ram_bytes_stored
