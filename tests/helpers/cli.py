"""The ``hybridkv`` command line, run in this process (fast) or in a child (restarts)."""

import contextlib
import io
import os
import subprocess
import sys

from hybridkv.tools.cli import main


def cli(*args) -> subprocess.CompletedProcess:
    """Run the CLI in this process: for argument and input errors and quick commands, where a
    child would spend its time importing torch. Output is captured like a child's."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:          # argparse's own exits (usage errors, --version)
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def run_cli(*args, cwd=None, env=None, timeout=600) -> subprocess.CompletedProcess:
    """Run ``hybridkv`` in a real child process: for a restart, or two processes at once."""
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
