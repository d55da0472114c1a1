"""The engine core's stop signals wait for the writes in flight (``stopping.py``), in a child
process with real signals: vLLM's handler runs once, after the writes, whatever signals follow."""

import os
import signal
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import signal, sys, threading, time
    from hybridkv.integrations.vllm.stopping import drain_before_stop

    stopped = threading.Event()
    def vllm_handler(signum, frame):
        print("vllm handler", signal.Signals(signum).name, flush=True)
        stopped.set()
    vllm_handler.__module__ = "vllm.v1.engine.core"      # as the engine core's handler is
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, vllm_handler)

    def wait_written(limit):
        print("writing", flush=True)
        time.sleep(0.5)
        print("written", flush=True)
        return True

    print("installed", drain_before_stop(wait_written), flush=True)
    while not stopped.wait(0.01):     # the engine thread runs on meanwhile
        pass
    time.sleep(0.3)                   # a second vLLM handler call would print by now
""")


def test_first_stop_signal_waits_for_the_writes_then_reaches_vllm_once():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().split() == ["installed", "True"]
    os.kill(child.pid, signal.SIGINT)            # the operator's Ctrl-C
    assert child.stdout.readline().strip() == "writing"
    os.kill(child.pid, signal.SIGTERM)           # vLLM's process manager, while writes land
    out, _ = child.communicate(timeout=10)
    assert child.returncode == 0
    assert out.splitlines() == ["written", "vllm handler SIGINT"]


def test_other_handlers_are_left_alone():
    script = textwrap.dedent("""
        import signal
        from hybridkv.integrations.vllm.stopping import drain_before_stop
        before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
        print(drain_before_stop(lambda limit: True),
              before == [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stderr
