"""The operators' stats file, written off vLLM's engine loop.

Turning a summary into JSON and writing it took ~2 ms once a second inside vLLM's scheduler
(0.2% of its time on 2 cores, most of the cost a miss adds there). The loop now only takes
the summary (~0.15 ms, a snapshot of plain containers) and a writer thread does the rest; a
summary that arrives while the previous one is still being written waits for the next
interval. At close the last summary is written before the call returns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

# rewritten at most this often as requests finish (and when the engine stops): rewriting it
# at every finish cost a 64-request batch 20% of its engine time on 2 cores
STATS_INTERVAL_S = 1.0


class StatsFile:
    """Atomic rewrites of one JSON file. The temp file gets an unpredictable name, created
    exclusively (a link planted in a shared directory is never followed, and several engines
    given one file do not collide); a file that cannot be written is logged once and counted,
    never raised into vLLM."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.errors = 0
        self._written = float("-inf")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hybridkv-stats")
        self._pending: Future | None = None

    def due(self) -> bool:
        """Is a rewrite due (the interval passed and no write is in flight)?"""
        return (time.monotonic() - self._written >= STATS_INTERVAL_S
                and (self._pending is None or self._pending.done()))

    def write_soon(self, summary: dict) -> None:
        """Hand ``summary`` (containers nothing else changes) to the writer thread."""
        self._written = time.monotonic()
        try:
            self._pending = self._pool.submit(self._write, summary)
        except RuntimeError:          # the interpreter is shutting down: no thread takes it
            self._write(summary)

    def write_now(self, summary: dict) -> None:
        """Write ``summary`` before returning, once the write in flight (if any) landed and
        the thread stopped."""
        self._pool.shutdown()
        self._write(summary)

    def wait(self) -> None:
        """Until the write in flight, if any, has landed."""
        if self._pending is not None:
            self._pending.result()

    def _write(self, summary: dict) -> None:
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(summary, default=str))
            os.replace(tmp, self.path)
        except Exception as e:        # a full disk, a gone directory: logged, never raised
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if not self.errors:
                log.warning("hybridkv: cannot write stats_file %s (%s); serving on without it",
                            self.path, getattr(e, "strerror", None) or e)
            self.errors += 1
