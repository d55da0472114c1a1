"""The store admin commands (inspect, verify, gc) through the CLI."""

import json

from hybridkv.tiers import pagefile

from helpers.cli import assert_one_line_error, cli
from helpers.tier_worker import written_tier


def test_inspect_verify_gc_cli(tmp_path):
    written_tier(tmp_path, n=4).close()
    out = json.loads(cli("inspect", "--store", tmp_path, "--json").stdout)
    ns = out["namespaces"][0]
    assert ns["model"] == "tier-test" and ns["quarantined"] == 0
    assert [(g["id"], g["kind"], g["files"]) for g in ns["groups"]] == [(0, "attention", 4), (1, "state", 4)]
    assert out["total_bytes"] == 4 * (4096 + 16384 + 2 * pagefile.HEADER_BYTES)

    proc = cli("verify", "--store", tmp_path, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == {"checked": 8, "ok": 8, "corrupt": 0, "quarantined": 0}
    victim = next((tmp_path / ns["fingerprint"] / "g1").glob("*/*.blk"))
    blob = bytearray(victim.read_bytes())
    blob[-1] ^= 0xFF
    victim.write_bytes(bytes(blob))
    proc = cli("verify", "--store", tmp_path, "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout) == {"checked": 8, "ok": 7, "corrupt": 1, "quarantined": 1}
    assert json.loads(cli("inspect", "--store", tmp_path, "--json").stdout)["namespaces"][0]["quarantined"] == 1

    proc = cli("gc", "--store", tmp_path, "--max-bytes", "10KiB", "--json")
    result = json.loads(proc.stdout)
    assert result["total_bytes"] <= 10 * 1024 and result["removed_files"] >= 5


def test_store_cli_errors(tmp_path):
    assert_one_line_error(cli("inspect", "--store", tmp_path / "nope"), "does not exist")
    assert_one_line_error(cli("gc", "--store", tmp_path, "--max-bytes", "lots"), "--max-bytes")
    assert_one_line_error(cli("inspect"), "--store DIR or --remote URL")
