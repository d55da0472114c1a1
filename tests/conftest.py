import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "examples" / "layouts"


def run_cli(*args, cwd=None, env=None, timeout=600):
    """Run ``hybridkv`` in a real child process; returns CompletedProcess with text output."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "hybridkv", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, env=full_env, timeout=timeout,
    )


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture
def seed_layout_dict():
    return json.loads((LAYOUTS / "seed-flash-next.json").read_text())
