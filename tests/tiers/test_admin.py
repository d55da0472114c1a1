"""The store admin commands (inspect, verify, gc) through the CLI."""

import dataclasses
import json
import os
import time

from hybridkv.tiers import admin, pagefile
from hybridkv.tiers.admin import verify_store
from hybridkv.tiers.filesystem import FilesystemTier

from helpers.cli import assert_one_line_error, cli, run_cli
from helpers.processes import spawn
from helpers.tier_worker import LAYOUT, key, page, written_tier


def test_inspect_verify_gc_cli(tmp_path):
    written_tier(tmp_path, n=4).close()
    out = json.loads(cli("inspect", "--store", tmp_path, "--json").stdout)
    ns = out["namespaces"][0]
    assert ns["model"] == "tier-test" and ns["quarantined"] == 0
    assert [(g["id"], g["kind"], g["files"]) for g in ns["groups"]] == [(0, "attention", 4), (1, "state", 4)]
    assert out["total_bytes"] == 4 * (4096 + 16384 + 2 * pagefile.HEADER_BYTES)

    proc = cli("verify", "--store", tmp_path, "--json")
    clean = {"checked": 8, "ok": 8, "corrupt": 0, "quarantined": 0, "vanished": 0, "unreadable": 0}
    assert proc.returncode == 0 and json.loads(proc.stdout) == clean
    victim = next((tmp_path / ns["fingerprint"] / "g1").glob("*/*.blk"))
    blob = bytearray(victim.read_bytes())
    blob[-1] ^= 0xFF
    victim.write_bytes(bytes(blob))
    proc = cli("verify", "--store", tmp_path, "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout) == {**clean, "ok": 7, "corrupt": 1, "quarantined": 1}
    assert json.loads(cli("inspect", "--store", tmp_path, "--json").stdout)["namespaces"][0]["quarantined"] == 1

    proc = cli("gc", "--store", tmp_path, "--max-bytes", "10KiB", "--json")
    result = json.loads(proc.stdout)
    assert result["total_bytes"] <= 10 * 1024 and result["removed_files"] >= 5


def test_store_cli_errors(tmp_path):
    assert_one_line_error(cli("inspect", "--store", tmp_path / "nope"), "does not exist")
    assert_one_line_error(cli("gc", "--store", tmp_path, "--max-bytes", "lots"), "--max-bytes")
    assert_one_line_error(cli("inspect"), "--store DIR or --remote URL")


def test_verify_beside_an_eviction_and_a_failing_disk_quarantines_nothing_healthy(tmp_path, monkeypatch):
    """Files removed between verify's listing and its read (an engine's eviction or a gc, both
    safe beside verify) have vanished; a read that fails with EIO is unreadable. Neither is
    corrupt, and nothing healthy moves to quarantine."""
    written_tier(tmp_path, n=4).close()
    opened = []
    real_open = admin.open_page

    def racing_open(path, flags):
        if not str(path).endswith(".blk"):    # the namespace's manifest, read at open
            return real_open(path, flags)
        opened.append(path)
        if len(opened) == 1:
            path.unlink()                     # evicted after the listing
        if len(opened) == 2:
            raise OSError(5, "Input/output error")
        return real_open(path, flags)

    monkeypatch.setattr(admin, "open_page", racing_open)
    result = verify_store(tmp_path, progress=False)
    assert result == {"checked": 8, "ok": 6, "corrupt": 0, "quarantined": 0, "vanished": 1, "unreadable": 1}
    assert opened[1].exists()                 # the unreadable file stays where it is



def test_gc_removes_namespaces_unused_for_days_and_size_gc_takes_old_namespaces_first(tmp_path):
    """Every upgrade (model, vLLM, hybridkv) starts a new namespace and leaves the old one."""
    old_layout = dataclasses.replace(LAYOUT, model="tier-test-before-the-upgrade")
    old = FilesystemTier(tmp_path, old_layout)
    for i in range(4):
        assert old.write(0, key(i), page(0, i))
    old.close()
    written_tier(tmp_path, n=4).close()
    month_ago = time.time() - 40 * 86400
    for path in old.namespace.rglob("*"):
        os.utime(path, (month_ago, month_ago), follow_symlinks=False)
    listed = {ns["model"]: ns for ns in json.loads(cli("inspect", "--store", tmp_path, "--json").stdout)["namespaces"]}
    assert listed["tier-test-before-the-upgrade"]["last_used"] < listed["tier-test"]["last_used"]

    fits_new = str(listed["tier-test"]["total_bytes"])
    by_size = json.loads(cli("gc", "--store", tmp_path, "--max-bytes", fits_new, "--json").stdout)
    assert by_size["removed_files"] == 4 and by_size["removed_namespaces"] == []    # the old pages went first
    assert json.loads(cli("verify", "--store", tmp_path, "--json").stdout)["ok"] == 8

    (tmp_path / "keep").mkdir()                 # not a namespace: never touched
    result = json.loads(cli("gc", "--store", tmp_path, "--unused-days", "30", "--json").stdout)
    assert result["removed_namespaces"] == [old.namespace.name] and result["removed_files"] == 0
    assert [ns["model"] for ns in json.loads(cli("inspect", "--store", tmp_path, "--json").stdout)["namespaces"]] == ["tier-test"]
    assert (tmp_path / "keep").is_dir()
    assert_one_line_error(cli("gc", "--store", tmp_path), "--max-bytes SIZE, --unused-days N or both")


def test_verify_beside_a_writing_engine_and_a_running_gc_finds_nothing_corrupt(tmp_path):
    """Real processes: an engine stand-in writes pages as fast as it can while `hybridkv gc`
    keeps the store under a size and `hybridkv verify` checks it. Files gc removes between
    verify's listing and its read have vanished, files being written are not listed (temp
    names): verify reports nothing corrupt and moves nothing to quarantine."""
    import signal
    import threading

    writer = spawn("write", tmp_path, 0, "--storm")
    assert writer.stdout.readline().strip() == "storming"
    stop, gcs = threading.Event(), []

    def collect():
        while not stop.is_set():
            gcs.append(run_cli("gc", "--store", tmp_path, "--max-bytes", "4MiB", "--json").returncode)

    collector = threading.Thread(target=collect)
    collector.start()
    try:
        results = []
        deadline = time.monotonic() + 120      # a loaded machine: until verify has checked pages
        while (len(results) < 4 or not gcs or not any(r["checked"] for r in results)) and time.monotonic() < deadline:
            proc = run_cli("verify", "--store", tmp_path, "--json")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            results.append(json.loads(proc.stdout))
    finally:
        stop.set()
        collector.join()
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert all(r["corrupt"] == 0 and r["quarantined"] == 0 for r in results), results
    assert sum(r["checked"] for r in results) > 0 and set(gcs) == {0}
    assert not any((tmp_path / ns / "quarantine").exists() for ns in os.listdir(tmp_path))
