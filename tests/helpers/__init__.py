"""Shared test helpers: real child processes, the CLI in and out of process, a real Redis."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
LAYOUTS = ROOT / "examples" / "layouts"
