"""The manager benchmark's peer: vLLM's own CPUOffloadingManager on hybridkv's trace."""

from hybridkv.tools import bench_manager
from hybridkv.tools.bench_report import manager_table


def test_vllm_manager_runs_the_same_trace():
    peer = bench_manager.measure(4096, "lru", repeats=1, backend="vllm")
    ours = bench_manager.measure(4096, "lru", repeats=1)
    assert set(peer) == set(ours)
    assert all(peer[f] > 0 for f in ("lookup_ops_per_s", "store_cycles_per_s", "touch_ops_per_s"))


def test_vllm_side_runs_as_a_child_and_reaches_the_report():
    assert bench_manager.vllm_python() is not None
    peer = bench_manager.measure_vllm(2048, "arc", 1)
    assert "error" not in peer and peer["store_cycles_per_s"] > 0
    ours = {p: bench_manager.measure(2048, p, 1) for p in ("lru", "arc")}
    section = "\n".join(manager_table({"slots": 2048, **ours, "vllm": {"arc": peer}}))
    assert "| vLLM CPUOffloadingManager arc, same run |" in section
    assert "| ratio hybridkv / vLLM arc |" in section

