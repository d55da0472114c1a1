"""Writes in flight land before vLLM stops.

On SIGINT or SIGTERM, vLLM 0.32's engine core leaves its busy loop, restores the default
SIGTERM action and only then shuts the connector down, while the API server's process
manager sends the engine core a SIGTERM as soon as it stops itself. The connector's
``shutdown`` therefore often does not run on a signalled stop (a race), and pages whose disk or Redis write
was still in flight were lost (a restart then missed the last requests' prefixes).

So in the engine core, the first stop signal is held: a thread waits for the writes (at most
``DRAIN_LIMIT_S``), then hands the signal to the handler vLLM installed. vLLM's process
manager still kills the engine once its ``--shutdown-timeout`` (default 0: at once) has run
out, so that option decides whether the writes may land.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DRAIN_LIMIT_S = 10.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
VLLM_HANDLER_MODULE = "vllm.v1.engine.core"   # where the engine core's signal handler lives


def drain_before_stop(wait_written: Callable[[float], bool]) -> bool:
    """Hold the engine core's stop signals until ``wait_written(limit)`` returned; True if
    the handlers were installed (only over vLLM's own, in the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    if not all(getattr(h, "__module__", None) == VLLM_HANDLER_MODULE for h in handlers.values()):
        return False                 # not vLLM's engine core: an interpreter exit drains (atexit)
    stopping = threading.Event()
    first: list[int] = []

    def hold(signum, frame) -> None:
        # A signal handler may interrupt the engine thread anywhere: no locks, no thread start.
        if not first:
            first.append(signum)
            stopping.set()

    def drain_then_stop() -> None:
        stopping.wait()
        t0 = time.monotonic()
        try:
            landed = wait_written(DRAIN_LIMIT_S)
            log.info("hybridkv: stop signal held %.1f ms while writes landed%s",
                     (time.monotonic() - t0) * 1e3, "" if landed else f" (gave up after {DRAIN_LIMIT_S:.0f} s)")
        except Exception:
            log.exception("hybridkv: writes at stop failed; stopping anyway")
        handlers[first[0]](first[0], None)

    threading.Thread(target=drain_then_stop, name="hybridkv-stop", daemon=True).start()
    for s in STOP_SIGNALS:
        signal.signal(s, hold)
    return True
