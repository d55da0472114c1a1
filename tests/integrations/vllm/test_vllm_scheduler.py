"""The scheduler half with the reads in the background, step by step, as vLLM drives it: lookup,
allocation, the step plans, the worker's report. vLLM's own config and KV-cache objects, a real
disk store; one request at a time, so that every path (landed, failed, aborted) is certain."""

import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridkv import connector as connector_module
from hybridkv.cache import store_pages
from hybridkv.core.errors import HybridKVError
from hybridkv.integrations.vllm import stats_file as stats_file_module
from hybridkv.integrations.vllm.messages import ENGINE_S_ALONE, RankReport, WorkerReport
from hybridkv.integrations.vllm.scheduler import SchedulerSide
from hybridkv.integrations.vllm.worker import WorkerSide

from engines import corrupt_stored_page, tokens, vllm_objects

B = 128
PROMPT = tokens(51, 3 * B + 1)          # three blocks and the replay boundary's state at 3B
BLOCK_IDS = ([7, 8, 9], [4, 5, 6])      # vLLM's blocks for the request: state group, attention


def scheduler(tmp_path, policy="recompute", **extra) -> SchedulerSide:
    config, kv = vllm_objects(block=B)
    config.kv_transfer_config = SimpleNamespace(kv_load_failure_policy=policy)
    config.shutdown_timeout = 10
    return SchedulerSide(config, kv, {"store": str(tmp_path / "store"), "ram_dir": str(tmp_path),
                                      "ram_bytes": "8MiB", **extra})


def request(rid="r"):
    return SimpleNamespace(request_id=rid, prompt_token_ids=PROMPT, cache_salt=None, lora_request=None,
                           mm_features=None, shared_prefix_boundary=3 * B)


def page(side, gid, seed):
    size = side.layout.group(gid).page_bytes
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def store_prompt(side) -> list[bytes]:
    """PROMPT's three attention blocks and its state at 3B, stored by request "writer"; its keys."""
    conn = side.connector
    state = conn.begin("writer", PROMPT)
    for b in range(3):
        conn.offer_block(state, b, {1: page(side, 1, b)})
    conn.offer_state(state, 3 * B, {0: page(side, 0, 99)})
    conn.finish(state)
    return state.keys


@pytest.fixture
def stored(tmp_path):
    """PROMPT's pages on disk, written by a first server."""
    side = scheduler(tmp_path)
    keys = store_prompt(side)
    side.close()
    return tmp_path, keys


def lookup_and_allocate(side) -> int:
    tokens = side.match(request(), 0)
    side.allocated(request(), BLOCK_IDS, tokens)
    return tokens


def test_a_load_goes_to_the_worker_once_its_reads_landed(stored):
    tmp_path, _ = stored
    side = scheduler(tmp_path)
    assert side.async_promotion and lookup_and_allocate(side) == 3 * B
    side.cache.drain()                       # the reads have landed (a later step)
    plan = side.plan_step({}, None, {})
    (attention,) = [c for c in plan.loads["r"] if c.group == 1]
    assert attention.blocks == BLOCK_IDS[1]
    region = side.cache.regions[1]
    assert all(np.array_equal(region.page(slot), page(side, 1, b)) for b, slot in enumerate(attention.slots))
    assert not plan.failed_loads and not plan.abandoned_loads
    side.close()


def test_a_read_that_fails_fails_the_load_and_the_request_gets_no_hit_again(stored):
    tmp_path, keys = stored
    corrupt_stored_page(tmp_path / "store", 1, keys[1])
    side = scheduler(tmp_path)
    assert lookup_and_allocate(side) == 3 * B      # the damage shows only when the page is read
    side.cache.drain()
    plan = side.plan_step({}, None, {})
    assert plan.failed_loads == {"r"} and not plan.loads
    assert side.stats.promotion_failures == 1
    worker = WorkerSide(*vllm_objects(block=B))
    worker.load(plan)
    assert worker.finished_loads() == (set(), {"r"})     # vLLM recomputes the request
    assert side.match(request(), 0) == 0
    side.finish("r")
    assert all(g["evictable"] == g["used"] for g in side.cache.stats()["groups"].values())
    side.close()


def test_a_request_aborted_while_its_reads_are_in_flight_is_reported_so_vllm_frees_its_blocks(stored):
    """vLLM holds the blocks of a request aborted in WAITING_FOR_REMOTE_KVS until the connector
    reports its load finished; a load never reported would keep them for good."""
    tmp_path, _ = stored
    side = scheduler(tmp_path)
    lookup_and_allocate(side)
    side.finish("r")                           # the abort, before any step planned the load
    plan = side.plan_step({}, None, {})
    assert plan.abandoned_loads == {"r"} and not plan.loads and not plan.failed_loads
    worker = WorkerSide(*vllm_objects(block=B))
    worker.load(plan)
    assert worker.finished_loads() == ({"r"}, set())
    side.cache.drain()
    assert all(g["evictable"] == g["used"] for g in side.cache.stats()["groups"].values())
    side.close()


def test_under_vllms_default_policy_the_reads_finish_inside_the_lookup(stored):
    tmp_path, _ = stored
    side = scheduler(tmp_path, policy="fail")
    assert not side.async_promotion
    lookup_and_allocate(side)
    assert side.cache.stats()["promotions_in_flight"] == 0
    assert set(side.plan_step({}, None, {}).loads) == {"r"}
    side.close()
    forced = scheduler(tmp_path, policy="fail", async_promotion=True)
    assert forced.async_promotion
    forced.close()
    with pytest.raises(HybridKVError, match='async_promotion=.yes. is not valid; use true, false or "auto"'):
        scheduler(tmp_path, async_promotion="yes")


def fresh_scheduler(tmp_path, tp=1, **extra) -> SchedulerSide:
    config, kv = vllm_objects(block=B, tp=tp)
    config.kv_transfer_config = SimpleNamespace(kv_load_failure_policy="fail")
    return SchedulerSide(config, kv, {"ram_dir": str(tmp_path), "ram_bytes": "8MiB", **extra})


def state_copies(plan):
    return [c for cs in plan.stores.values() for c in cs if c.group == 0]


def test_states_are_stored_only_where_vllm_hands_them_off_from_the_block_it_names(tmp_path):
    side = fresh_scheduler(tmp_path)
    side.match(request("w"), 0)
    span = {"w": (0, 3 * B)}                         # a chunk that ends on the block grid at 3B
    plan = side.plan_step(span, lambda rid: BLOCK_IDS, {})
    # the chunk's three attention blocks in one reservation, no state
    assert [c.blocks for cs in plan.stores.values() for c in cs] == [[4, 5, 6]] and not state_copies(plan)
    handoff = {"w": [(0, 42, 3 * B), (0, 43, 3 * B - 5)]}       # 3B - 5 is off this cache's grid
    plan = side.plan_step({}, lambda rid: BLOCK_IDS, handoff)
    (copy,) = state_copies(plan)
    assert copy.blocks == [42]                       # the block vLLM named, not the table's 9
    side.close()


def test_a_state_handed_off_where_the_retention_keeps_none_is_a_spare_kept_in_ram_only(tmp_path):
    side = scheduler(tmp_path)                       # with a disk store below RAM
    side.match(request("w"), 0)
    handoff = {"w": [(0, 41, B), (0, 43, 3 * B)]}    # the prompt's own state is at 3B (its tail at 2B)
    plan = side.plan_step({}, lambda rid: BLOCK_IDS, handoff)
    assert sorted(c.blocks for c in state_copies(plan)) == [[41], [43]]
    side.on_report(report(0, stored=set(plan.stores)))
    side.cache.drain()
    keys = side.connector.begin("probe", PROMPT).keys
    assert side.connector.stats["spare_states"] == 1
    assert side.cache.lookup(0, [keys[0], keys[2]], below_ram=False) == ["ram", "ram"]
    assert side.cache.secondaries[0].contains_many(0, [keys[0], keys[2]]) == [False, True]
    side.close()


def test_blocks_ram_cannot_take_at_once_are_reserved_one_by_one_from_the_first(tmp_path):
    config, kv = vllm_objects(block=B)
    config.kv_transfer_config = SimpleNamespace(kv_load_failure_policy="fail")
    side = SchedulerSide(config, kv, {"ram_dir": str(tmp_path), "ram_bytes": "512KiB"})
    assert side.cache.stats()["groups"][1]["slots"] == 7
    other = SimpleNamespace(**{**vars(request("x")), "prompt_token_ids": tokens(52, 5 * B + 1)})
    side.match(other, 0)
    side.plan_step({"x": (0, 5 * B)}, lambda rid: ([1] * 5, [11, 12, 13, 14, 15]), {})  # 5 slots being written
    side.match(request("w"), 0)
    plan = side.plan_step({"w": (0, 3 * B)}, lambda rid: BLOCK_IDS, {})
    assert sorted(c.blocks for cs in plan.stores.values() for c in cs) == [[4], [5]]   # 2 slots were left
    assert side.stats.stores_refused == 1            # the third block, refused
    side.close()


@pytest.mark.parametrize("insertion", ["warm", "cold"])
def test_the_pages_of_a_request_the_insertion_sends_in_cold_are_evicted_before_older_ones(tmp_path, insertion):
    config, kv = vllm_objects(block=B)
    config.kv_transfer_config = SimpleNamespace(kv_load_failure_policy="fail")
    side = SchedulerSide(config, kv, {"ram_dir": str(tmp_path), "ram_bytes": "512KiB", "insertion": insertion})
    older = [bytes([i]) * 16 for i in range(4)]
    assert store_pages(side.cache, {1: [(key, page(side, 1, i)) for i, key in enumerate(older)]})
    side.match(request("w"), 0)                      # no hit: cold under the cold insertion
    plan = side.plan_step({"w": (0, 3 * B)}, lambda rid: BLOCK_IDS, {})
    side.on_report(report(0, stored=set(plan.stores)))
    assert side.cache.stats()["groups"][1]["used"] == 7 == side.cache.stats()["groups"][1]["slots"]
    (victim,) = side.cache.prepare_store({1: [b"new" * 6]})[1].evicted
    probe = side.connector.begin("probe", PROMPT)
    side.connector.finish(probe)
    assert victim in probe.keys[:3] if insertion == "cold" else victim == older[0]
    side.close()


def test_a_request_asked_about_again_is_not_keyed_again_unless_the_cache_was_reset(tmp_path, monkeypatch):
    """vLLM asks again each step for a request it could not schedule: the same prompt list
    keeps its keys; an equal list of another request object, or a reset, is keyed afresh."""
    side = fresh_scheduler(tmp_path)
    keyed = []
    real = connector_module.block_hashes
    monkeypatch.setattr(connector_module, "block_hashes", lambda *a, **kw: keyed.append(1) or real(*a, **kw))
    asked = request()
    side.match(asked, 0)
    side.match(asked, 0)                             # not scheduled: asked again
    assert len(keyed) == 1
    side.match(SimpleNamespace(**{**vars(asked), "prompt_token_ids": list(PROMPT)}), 0)
    assert len(keyed) == 2
    side.reset()
    side.match(asked, 0)
    assert len(keyed) == 3
    side.close()


def test_a_request_asked_about_again_while_waiting_keeps_its_state_and_finds_pages_stored_since(tmp_path):
    """Between two asks about a waiting request another one stores its prompt: the second ask
    finds that hit on the same state, and the request is counted and recorded once."""
    side = fresh_scheduler(tmp_path)
    waiting = request("waiting")
    assert side.match(waiting, 0) == 0
    first = side.connector.stats["requests"]
    store_prompt(side)
    assert side.match(waiting, 0) == 3 * B           # not scheduled in between: asked again
    assert side.connector.stats["requests"] == first + 1      # the writer's begin, not a second one
    side.allocated(waiting, BLOCK_IDS, 3 * B)
    side.finish("waiting")
    assert [r["request"] for r in side.history] == ["waiting"]
    assert side.history[0]["loaded_tokens"] == 3 * B
    side.close()


def test_a_hit_vllm_declined_does_not_make_the_next_ask_load_within_the_step(stored):
    """vLLM took its own hit instead of one to load within the step, then asks again about
    the request while its pages are only on disk: that load must wait for the reads in a
    step of its own, not run in the step from slots not yet filled."""
    tmp_path, _ = stored
    side = scheduler(tmp_path)
    side.on_report(WorkerReport({0: RankReport(mapped=True)}))
    warm = side.connector.begin("warm", PROMPT)
    assert side.connector.load(warm) is not None                  # the pages are in RAM now
    side.connector.finish(warm)
    assert side.match(request(), 0) == 3 * B and side.loads_within_step("r")
    side.allocated(request(), BLOCK_IDS, 0)                        # vLLM chose its local hit
    side.cache.forget_ram()                                        # RAM lost them; disk has them
    assert side.match(request(), 0) == 3 * B                      # asked again
    assert not side.loads_within_step("r")
    side.allocated(request(), BLOCK_IDS, 3 * B)
    assert not side.plan_step({"r": (3 * B, 3 * B + 1)}, lambda rid: BLOCK_IDS, {}).loads_within_step
    side.cache.drain()
    side.close()


def test_a_step_asks_vllm_for_block_ids_only_where_it_completes_a_prompt_block(tmp_path):
    side = fresh_scheduler(tmp_path)
    side.match(request(), 0)
    asked = []

    def block_ids_of(rid):
        asked.append(rid)
        return BLOCK_IDS

    side.plan_step({"r": (0, B - 1)}, block_ids_of, {})             # no block completed yet
    side.plan_step({"r": (3 * B + 1, 3 * B + 2)}, block_ids_of, {})   # decoding, past the prompt
    assert asked == []
    plan = side.plan_step({"r": (B - 1, 3 * B + 1)}, block_ids_of, {})
    assert asked == ["r"] and sorted(b for cs in plan.stores.values() for c in cs for b in c.blocks) == [4, 5, 6]
    side.close()


def test_worker_hook_time_reaches_the_scheduler_with_a_report_or_alone_once_it_adds_up(tmp_path):
    side = fresh_scheduler(tmp_path)
    worker = WorkerSide(*vllm_objects(block=B))
    worker.count_hook("wait_for_save", ENGINE_S_ALONE / 2)     # a decoding step's hooks: nothing copied
    assert worker.take_report() is None and worker.take_counters()["load_bytes"] == 0
    worker.count_hook("start_load_kv", 1.5 * ENGINE_S_ALONE)   # enough to go on its own
    side.on_report(worker.take_report())
    assert side.stats.worker_engine_s == pytest.approx(2 * ENGINE_S_ALONE)
    assert side.stats.worker_hook_s == pytest.approx({"wait_for_save": ENGINE_S_ALONE / 2,
                                                      "start_load_kv": 1.5 * ENGINE_S_ALONE})
    assert worker.take_report() is None              # nothing new since
    assert worker.take_counters()["engine_s"] == pytest.approx(2 * ENGINE_S_ALONE)
    side.close()


def report(rank, **sets):
    return WorkerReport({rank: RankReport(**sets)})


def hit_tokens(side) -> int:
    probe = side.connector.begin("probe", PROMPT)
    side.connector.finish(probe)
    return probe.hit.tokens


def test_under_tensor_parallelism_a_page_is_published_only_when_every_rank_wrote_its_slice(tmp_path):
    side = fresh_scheduler(tmp_path, tp=2)
    assert side.layout.tp_size == 2 and side.layout.group(1).page_bytes == 2 * 2 * 128 * 2 * 32 * 4
    side.match(request("w"), 0)
    plan = side.plan_step({"w": (0, 3 * B + 1)}, lambda rid: BLOCK_IDS, {"w": [(0, 9, 3 * B)]})
    stores = set(plan.stores)
    assert len(stores) == 2                          # the three blocks' pages, the state
    side.on_report(report(1, stored=stores))
    assert hit_tokens(side) == 0                     # rank 0 has not written its slices yet
    side.on_report(report(0, stored=stores))
    assert hit_tokens(side) == 3 * B
    side.close()


def test_under_tensor_parallelism_one_rank_failing_a_store_fails_the_page(tmp_path):
    side = fresh_scheduler(tmp_path, tp=2)
    side.match(request("w"), 0)
    plan = side.plan_step({"w": (0, 3 * B + 1)}, lambda rid: BLOCK_IDS, {"w": [(0, 9, 3 * B)]})
    side.on_report(report(0, store_failures=set(plan.stores)))
    assert side.stats.store_failures == 0            # rank 1 may still be writing: slots held
    side.on_report(report(1, stored=set(plan.stores)))
    assert hit_tokens(side) == 0 and side.stats.store_failures == 2
    side.close()


def test_under_tensor_parallelism_a_hit_stays_pinned_until_every_rank_loaded_it(tmp_path):
    side = fresh_scheduler(tmp_path, tp=2)
    side.match(request("w"), 0)
    plan = side.plan_step({"w": (0, 3 * B + 1)}, lambda rid: BLOCK_IDS, {"w": [(0, 9, 3 * B)]})
    side.on_report(report(0, stored=set(plan.stores)).aggregate(report(1, stored=set(plan.stores))))
    side.finish("w")
    assert side.match(request("r"), 0) == 3 * B
    side.allocated(request("r"), BLOCK_IDS, 3 * B)
    side.plan_step({}, None, {})
    pinned = lambda: sum(g["used"] - g["evictable"] for g in side.cache.stats()["groups"].values())  # noqa: E731
    assert pinned() > 0
    side.on_report(report(0, loaded={"r"}))
    assert pinned() > 0                              # rank 1 may still be copying out of the slots
    side.on_report(report(1, loaded={"r"}))
    assert pinned() == 0
    side.close()


def test_a_stats_file_that_cannot_be_written_is_logged_once_and_never_raised(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(stats_file_module, "STATS_INTERVAL_S", 3600.0)     # however slow this machine
    side = scheduler(tmp_path, stats_file=str(tmp_path / "missing-dir" / "stats.json"))
    for rid in ("a", "b"):
        side.match(request(rid), 0)
        side.finish(rid)                     # hands the stats to the writer: inside vLLM's request_finished
    side.stats_file.wait()
    assert side.stats_file.errors == 1       # the second finish came within the interval
    side.close()                             # writes it whatever the interval
    assert side.stats_file.errors == 2
    assert caplog.text.count("cannot write stats_file") == 1


def test_the_stats_file_is_rewritten_at_most_once_an_interval_and_at_close(tmp_path, monkeypatch):
    monkeypatch.setattr(stats_file_module, "STATS_INTERVAL_S", 3600.0)     # however slow this machine
    path = tmp_path / "stats.json"
    side = scheduler(tmp_path, stats_file=str(path))
    side.match(request("a"), 0)
    side.finish("a")
    side.stats_file.wait()
    assert [r["request"] for r in json.loads(path.read_text())["requests"]] == ["a"]
    side.match(request("b"), 0)
    side.finish("b")                         # within the interval: not rewritten yet
    side.stats_file.wait()
    assert [r["request"] for r in json.loads(path.read_text())["requests"]] == ["a"]
    side.close()
    assert [r["request"] for r in json.loads(path.read_text())["requests"]] == ["a", "b"]


def test_the_stats_file_is_written_off_the_engine_loop_from_a_snapshot(tmp_path, monkeypatch):
    """The writer thread serializes what ``finish`` handed it, however the engine's counters
    move on meanwhile (the thread is held until they have)."""
    moved_on = threading.Event()

    def dumps_once_the_engine_moved_on(summary, **kwargs):
        assert moved_on.wait(10)
        return json.dumps(summary, **kwargs)

    monkeypatch.setattr(stats_file_module, "json", SimpleNamespace(dumps=dumps_once_the_engine_moved_on))
    path = tmp_path / "stats.json"
    side = scheduler(tmp_path, stats_file=str(path))
    side.count_hook("get_num_new_matched_tokens", 0.5)
    side.match(request("a"), 0)
    side.finish("a")
    side.count_hook("get_num_new_matched_tokens", 0.25)      # after the snapshot was taken
    side.count_hook("build_connector_meta", 0.125)
    moved_on.set()
    side.stats_file.wait()
    assert json.loads(path.read_text())["vllm"]["hook_s"] == {"get_num_new_matched_tokens": 0.5}
    side.close()
    assert json.loads(path.read_text())["vllm"]["hook_s"] == {"get_num_new_matched_tokens": 0.75,
                                                              "build_connector_meta": 0.125}


def test_a_stats_file_handed_over_once_its_writer_stopped_is_written_in_the_callers_thread(tmp_path):
    """At interpreter exit no thread takes new work: a summary handed over then is written at
    once, never raised into vLLM's request_finished."""
    path = tmp_path / "stats.json"
    writer = stats_file_module.StatsFile(path)
    writer.write_now({"n": 1})                   # the engine stopped: the writer thread is gone
    writer.write_soon({"n": 2})
    assert json.loads(path.read_text()) == {"n": 2} and writer.errors == 0


def test_the_stats_file_never_follows_a_link_planted_beside_it(tmp_path):
    """In a shared directory such as /tmp another user could plant a link at a predictable
    temp name; the engine (often root) would then overwrite the link's target."""
    target = tmp_path / "precious"
    target.write_text("keep")
    (tmp_path / "stats.json.tmp").symlink_to(target)
    side = scheduler(tmp_path, stats_file=str(tmp_path / "stats.json"))
    side.match(request("a"), 0)
    side.finish("a")
    side.close()
    assert target.read_text() == "keep" and "connector" in (tmp_path / "stats.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".stats", "stats"))) == \
        ["stats.json", "stats.json.tmp"]      # no temp file left behind


def test_a_hit_vllm_trims_is_recomputed_not_raised_in_vllms_scheduler(stored):
    tmp_path, _ = stored
    side = scheduler(tmp_path, policy="fail")
    assert side.match(request(), 0) == 3 * B
    side.allocated(request(), BLOCK_IDS, 2 * B)      # vLLM took fewer tokens than were pinned
    plan = side.plan_step({}, None, {})
    assert plan.failed_loads == {"r"} and not plan.loads and side.stats.hits_trimmed == 1
    assert all(g["evictable"] == g["used"] for g in side.cache.stats()["groups"].values())
    side.close()


def test_a_request_looked_up_again_keeps_its_pins_when_an_earlier_loads_acks_arrive(stored):
    """Under asynchronous scheduling a request can be preempted right after a load within the
    step and looked up again before the workers' reports of that load arrive: they must not
    unpin the new hit's pages."""
    tmp_path, _ = stored
    side = scheduler(tmp_path, policy="fail")
    side.on_report(report(0, mapped=True))
    assert side.match(request(), 0) == 3 * B and side.loads_within_step("r")
    targets = ([5, 6, 7, 8], [1, 2, 3, 4])
    side.allocated(request(), targets, 3 * B)
    (load,) = side.plan_step({"r": (3 * B, 3 * B + 1)}, lambda rid: targets, {}).loads_within_step
    assert side.match(request(), 0) == 3 * B              # preempted, looked up again
    pinned = lambda: sum(g["used"] - g["evictable"] for g in side.cache.stats()["groups"].values())  # noqa: E731
    held = pinned()
    side.on_report(report(0, loaded={load}))              # the first load's report, late
    assert pinned() == held > 0
    side.finish("r")
    assert pinned() == 0
    side.close()


def test_a_load_within_the_step_that_vllm_trims_stops_rather_than_computes_from_unfilled_blocks(stored):
    """vLLM runs such a request in this very step and hears of no failure, so recomputing it
    is not on offer; hybridkv never offers a load within the step where vLLM may trim one."""
    tmp_path, _ = stored
    side = scheduler(tmp_path, policy="fail")
    side.on_report(report(0, mapped=True))                 # the worker has mapped the regions
    assert side.match(request(), 0) == 3 * B and side.loads_within_step("r")
    with pytest.raises(HybridKVError, match="accepted 256 external tokens .* set load_within_step: false"):
        side.allocated(request(), BLOCK_IDS, 2 * B)
    side.close()


def test_lora_adapters_are_keyed_by_their_weights_not_their_name(tmp_path):
    from hybridkv.integrations.vllm.request_identity import request_identity

    def adapter(directory, weights):
        directory.mkdir()
        (directory / "adapter_config.json").write_text('{"r": 8}')
        (directory / "adapter_model.safetensors").write_bytes(weights)
        return SimpleNamespace(lora_name="support-bot", lora_int_id=1, lora_path=str(directory))

    def salt(lora):
        return request_identity(SimpleNamespace(cache_salt=None, lora_request=lora, mm_features=None))[0]

    a, b = adapter(tmp_path / "a", b"1" * 64), adapter(tmp_path / "b", b"2" * 64)
    same_as_a = adapter(tmp_path / "copy-of-a", b"1" * 64)
    assert salt(a) != salt(b)                 # one name, two sets of weights: never one page
    assert salt(a) == salt(same_as_a)         # the same weights share pages wherever they live


def test_a_hub_model_without_a_commit_gets_no_persistent_tiers(tmp_path):
    config, kv = vllm_objects(block=B, model="org/model", commit=None)
    with pytest.raises(HybridKVError, match="cannot tell which weights org/model holds .* Pass --revision"):
        SchedulerSide(config, kv, {"store": str(tmp_path / "store"), "ram_dir": str(tmp_path)})
    SchedulerSide(config, kv, {"ram_dir": str(tmp_path), "ram_bytes": "8MiB"}).close()   # RAM only is fine



def worker_tensors(seed):
    """What vLLM registers for vllm_objects' model on one rank: two Mamba-style layers (int8
    views of 1,536 real bytes in 64 KiB padded pages), one attention layer [16, 2, 128, 64]."""
    from hybridkv.tools.gpu_check import attention_caches, state_caches

    (attention,) = attention_caches("LBHNC", layers=1, blocks=16, heads=2, tokens=128, width=64,
                                    dtype=torch.int32, seed=seed)
    l0, l1 = state_caches(2, 16, 1536, 65536, seed=seed)
    return {"l0": l0, "l1": l1, "l2": attention.view(torch.float32)}


def stored_by_workers(side, workers, sources) -> None:
    """Request "w" computed: every worker saves its slices of the blocks the scheduler
    planned, and the scheduler publishes the pages once each reported."""
    for worker, tensors in zip(workers, sources, strict=True):
        worker.register(tensors)
    side.match(request("w"), 0)
    plan = side.plan_step({"w": (0, 3 * B + 1)}, lambda rid: BLOCK_IDS, {"w": [(0, 9, 3 * B)]})
    merged = None
    for worker in workers:
        worker.store(plan)
        part = worker.take_report()
        merged = part if merged is None else merged.aggregate(part)
    side.on_report(merged)
    side.finish("w")


def test_two_ranks_store_and_load_their_slices_through_the_scheduler(tmp_path):
    """The whole TP=2 path in one process: both workers save their slices of the blocks the
    scheduler planned, the page is published once both reported, and a later hit loads each
    rank's slice back into that rank's (empty) tensors, bit for bit. Every page is in RAM and
    both ranks have mapped the regions, so the load runs in the step that runs the request
    (vLLM never hears of it), and the state also goes into the column that step's chunk ends
    in, which vLLM's forward reads."""
    side = fresh_scheduler(tmp_path, tp=2)
    config, kv = vllm_objects(block=B, tp=2)
    sources = [worker_tensors(seed) for seed in (1, 2)]
    workers = [WorkerSide(config, kv, rank=r) for r in (0, 1)]
    stored_by_workers(side, workers, sources)
    assert side.match(request("r"), 0) == 3 * B and side.loads_within_step("r")
    targets = ([5, 6, 7, 8], [1, 2, 3, 4])         # other blocks this time, one more for the chunk
    side.allocated(request("r"), targets, 3 * B)
    plan = side.plan_step({"r": (3 * B, 3 * B + 1)}, lambda rid: targets, {})
    (load,) = plan.loads_within_step                # an id of its own, not the request's
    empty = [{k: torch.zeros_like(v) for k, v in worker_tensors(0).items()} for _ in workers]
    merged = None
    for worker, tensors in zip(workers, empty, strict=True):
        worker.register(tensors)
        worker.load(plan)
        assert worker.finished_loads() == (set(), set())      # vLLM expects no word of it
        part = worker.take_report()
        assert part.ranks[worker.rank].loaded == {load}
        merged = part if merged is None else merged.aggregate(part)
    for src, dst in zip(sources, empty, strict=True):
        for b, (s_block, d_block) in enumerate(zip(BLOCK_IDS[1], targets[1][:3], strict=True)):
            assert torch.equal(src["l2"][s_block].view(torch.int32), dst["l2"][d_block].view(torch.int32)), b
        for layer in ("l0", "l1"):                  # the state at 3B: vLLM's block 9 -> 7, and 8
            assert torch.equal(src[layer][9], dst[layer][7]) and torch.equal(src[layer][9], dst[layer][8])
    side.on_report(merged)
    assert all(g["evictable"] == g["used"] for g in side.cache.stats()["groups"].values())
    for worker in workers:
        worker.close()
    side.close()


def test_a_state_loaded_in_a_step_also_feeds_a_request_that_hit_it_in_vllms_own_cache(tmp_path):
    """vLLM caches the blocks of a synchronous load at once, so a second request scheduled in
    the same step could hit the loaded state block in vLLM's own cache (0.32 defers it a
    step; nothing promises that); its pre-copy would read that block before the step's loads
    run, so the loaded state goes into its running column too."""
    side = fresh_scheduler(tmp_path)
    worker = WorkerSide(*vllm_objects(block=B))
    source = worker_tensors(1)
    stored_by_workers(side, [worker], [source])
    assert side.match(request("r"), 0) == 3 * B
    first, second = ([5, 6, 7, 8], [1, 2, 3, 4]), ([5, 6, 7, 11], [1, 2, 3, 12])   # block 7 shared
    side.allocated(request("r"), first, 3 * B)
    plan = side.plan_step({"r": (3 * B, 3 * B + 1), "s": (3 * B, 3 * B + 1)},
                          {"r": first, "s": second}.__getitem__, {})
    empty = {k: torch.zeros_like(v) for k, v in worker_tensors(0).items()}
    worker.register(empty)
    worker.load(plan)
    for layer in ("l0", "l1"):
        assert all(torch.equal(source[layer][9], empty[layer][block]) for block in (7, 8, 11)), layer
    assert not empty["l0"][10].any()                 # nothing else written
    worker.close()
    side.close()


def test_a_load_runs_in_a_step_of_its_own_until_every_worker_mapped_the_regions(stored):
    """The first hit of a new process: no worker has copied yet, so a failed mapping could still
    fail the load, which only an asynchronous load can report. Once a rank has, loads run
    within the step; ``load_within_step: false`` keeps every load in a step of its own."""
    tmp_path, _ = stored
    side = scheduler(tmp_path, policy="fail")
    assert side.match(request(), 0) == 3 * B and not side.loads_within_step("r")
    side.allocated(request(), BLOCK_IDS, 3 * B)
    side.plan_step({}, None, {})
    side.on_report(report(0, loaded={"r"}))
    side.finish("r")
    assert not side.loads_within_step("r")          # a load is not a mapping: a store or load says so
    assert side.match(request("again"), 0) == 3 * B and not side.loads_within_step("again")
    side.finish("again")
    side.on_report(report(0, mapped=True))
    assert side.match(request("again"), 0) == 3 * B and side.loads_within_step("again")
    side.close()
    off = scheduler(tmp_path, policy="fail", load_within_step=False)
    off.on_report(report(0, mapped=True))
    assert off.match(request("again"), 0) == 3 * B and not off.loads_within_step("again")
    off.close()
    with pytest.raises(HybridKVError, match="load_within_step='no' is not valid; use true or false"):
        scheduler(tmp_path, load_within_step="no")


def test_a_worker_that_cannot_pin_the_regions_stops_the_engine_with_one_line(tmp_path):
    from hybridkv.device.pinning import cuda_pin_hook
    from hybridkv.ram.regions import PinningFailed

    side = fresh_scheduler(tmp_path)
    worker = WorkerSide(*vllm_objects(block=B))
    worker.register(worker_tensors(1))
    worker.copier.pin_hook = cuda_pin_hook(lambda address, size: 2, lambda address: None, attempts=2, backoff_s=0)
    side.match(request("w"), 0)
    plan = side.plan_step({"w": (0, 3 * B + 1)}, lambda rid: BLOCK_IDS, {})
    with pytest.raises(PinningFailed, match=r"rank 0: .* cudaHostRegister failed 2 times \(error codes \[2, 2\]\)"):
        worker.store(plan)
    side.close()


def test_start_up_names_the_tested_vllm_versions_and_warns_on_others(tmp_path, monkeypatch, caplog):
    import vllm

    caplog.set_level("INFO", logger="hybridkv")
    fresh_scheduler(tmp_path).close()
    assert "a version this release was tested with" in caplog.text
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    caplog.clear()
    fresh_scheduler(tmp_path).close()
    assert "vLLM 0.99.0 is not one this release was tested with (0.32.0)" in caplog.text



def test_the_prompts_own_state_is_asked_for_and_stored_on_the_configured_grid(tmp_path):
    """States kept on a two-block grid: a prompt whose replay boundary is at 3 blocks asks vLLM
    to stop (and keep the state) at 2 and stores only that one; a prompt whose junction takes
    the one stop vLLM allows keeps its own state at the replay boundary instead, where vLLM's
    own stop hands it off."""
    config, kv = vllm_objects(block=B)
    config.kv_transfer_config = SimpleNamespace(kv_load_failure_policy="fail")
    side = SchedulerSide(config, kv, {"ram_dir": str(tmp_path), "ram_bytes": "8MiB", "state_align": 2 * B,
                                      "spare_states": False})   # the grid alone, no spare states

    def ask(rid, prompt, handoff):
        req = SimpleNamespace(request_id=rid, prompt_token_ids=prompt, cache_salt=None, lora_request=None,
                              mm_features=None, shared_prefix_boundary=0)
        side.match(req, 0)
        plan = side.plan_step({}, lambda r: BLOCK_IDS, {rid: [(0, 40 + k, b) for k, b in enumerate(handoff)]})
        return req.shared_prefix_boundary, sorted(handoff[c.blocks[0] - 40] for c in state_copies(plan))

    assert ask("a", tokens(60, 3 * B + 1), [B, 2 * B, 3 * B]) == (2 * B, [2 * B])
    shared = tokens(61, 3 * B + 1)
    writer = side.connector.begin("writer", shared)          # three blocks stored, no state
    for b in range(3):
        side.connector.offer_block(writer, b, {1: page(side, 1, b)})
    side.connector.finish(writer)
    follow_up = shared[: 3 * B] + tokens(62, 2 * B + 1)      # replay 5B; attention reaches 3B
    # vLLM hands off the junction it was asked for and its own stop at the replay boundary
    assert ask("b", follow_up, [3 * B, 5 * B]) == (3 * B, [3 * B, 5 * B])
    side.close()


def test_a_replan_over_one_arena_keeps_the_regions_the_workers_mapped_and_their_pages(tmp_path):
    """Over one arena a re-plan changes only the plan: the regions stay, so no rank has
    anything to map again, the pages stored before still hit, and their load still runs
    within the step."""
    side = fresh_scheduler(tmp_path, ram_bytes="64MiB")
    assert side.cache.shared_ram_bytes is not None
    config, kv = vllm_objects(block=B)
    worker = WorkerSide(config, kv, rank=0)
    stored_by_workers(side, [worker], [worker_tensors(1)])
    regions = dict(side.cache.regions)
    infos = side.plan_step({}, lambda rid: BLOCK_IDS, {}).regions
    assert side.cache.replan(side.cache.plan.reference_tokens * 4)
    assert side.cache.regions == regions and all(r.path.exists() for r in regions.values())
    assert side.plan_step({}, lambda rid: BLOCK_IDS, {}).regions is infos
    assert side.match(request("r"), 0) == 3 * B and side.loads_within_step("r")
    side.finish("r")
    worker.close()
    side.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_after_the_cache_replans_ram_the_workers_map_the_new_regions_and_store_and_load_there(tmp_path, tp):
    """A cache not told the prompt length re-plans RAM once it has learned it: new regions,
    the old ones dropped. Every rank must map the new ones before its next copy (and unmap
    the old), and a page stored there must load back into each rank's slice bit for bit."""
    side = fresh_scheduler(tmp_path, tp=tp, ram_split="static")
    config, kv = vllm_objects(block=B, tp=tp)
    sources = [worker_tensors(seed) for seed in range(1, tp + 1)]
    workers = [WorkerSide(config, kv, rank=r) for r in range(tp)]
    stored_by_workers(side, workers, sources)
    old = [dict(w.regions) for w in workers]
    reference = side.cache.plan.reference_tokens * 4
    assert any(side.cache.replan(reference) or time.sleep(0.01) for _ in range(1000))   # when made
    assert not any(r.path.exists() for regions in old for r in regions.values())
    assert side.match(request("r"), 0) == 0            # the RAM pages went with the old regions
    side.finish("r")
    stored_by_workers(side, workers, sources)          # each rank maps the new regions to store
    for worker in workers:
        assert {gid: r.path for gid, r in worker.regions.items()} == {
            gid: r.path for gid, r in side.cache.regions.items()}
    assert all(r.array is None for regions in old for r in regions.values())     # unmapped
    assert side.match(request("r"), 0) == 3 * B
    assert side.loads_within_step("r")                 # every rank reported the new regions mapped
    targets = ([5, 6, 7, 8], [1, 2, 3, 4])
    side.allocated(request("r"), targets, 3 * B)
    plan = side.plan_step({"r": (3 * B, 3 * B + 1)}, lambda rid: targets, {})
    empty = [{k: torch.zeros_like(v) for k, v in worker_tensors(0).items()} for _ in workers]
    merged = None
    for worker, tensors in zip(workers, empty, strict=True):
        worker.register(tensors)
        worker.load(plan)
        part = worker.take_report()
        merged = part if merged is None else merged.aggregate(part)
    side.on_report(merged)
    for src, dst in zip(sources, empty, strict=True):
        for s_block, d_block in zip(BLOCK_IDS[1], targets[1][:3], strict=True):
            assert torch.equal(src["l2"][s_block].view(torch.int32), dst["l2"][d_block].view(torch.int32))
        assert torch.equal(src["l0"][9], dst["l0"][7])
    for worker in workers:
        worker.close()
    side.close()
