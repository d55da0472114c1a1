"""Child processes running ``tier_worker.py``: real writers, readers and region owners."""

import os
import subprocess
import sys

from helpers import TESTS

WORKER = TESTS / "helpers" / "tier_worker.py"


def _env() -> dict:
    # The child imports helpers from tests/ and hybridkv from the install.
    return dict(os.environ, PYTHONPATH=str(TESTS))


def worker(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True,
                          text=True, env=_env(), timeout=120, **kw)


def spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], stdout=subprocess.PIPE,
                            text=True, env=_env())
