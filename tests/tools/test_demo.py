import json

import pytest

from helpers.cli import run_cli


@pytest.mark.long
def test_demo_tells_the_whole_story(tmp_path):
    chart = tmp_path / "demo.png"
    proc = run_cli("demo", "--prompt-tokens", "640", "--json", "--plot", chart, "--store", tmp_path / "s")
    assert proc.returncode == 0, proc.stderr
    steps = {s["name"]: s for s in json.loads(proc.stdout)}
    assert all(s["identical"] for s in steps.values())
    assert steps["cold A"]["hit_tokens"] == 0
    assert steps["A again (RAM)"]["source"] == "ram" and steps["A again (RAM)"]["hit_tokens"] == 576
    assert steps["sibling A' (junction)"]["junction"] == 384
    assert steps["sibling A'' (hits junction)"]["hit_tokens"] == 384
    assert steps["new process: A (disk)"]["source"] == "fs"
    assert steps["C again (RAM)"]["source"] == "ram"
    assert "fs" in steps["A again (disk after eviction)"]["source"]
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
