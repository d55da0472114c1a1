import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# tests/vllm needs vLLM, which lives in .venv-vllm; scripts/test.sh runs it there.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]
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


def free_port(below: int = 65536) -> int:
    """A free loopback port; cluster nodes need port + 10000 free too, so ask for one below 55536."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, min(below, 60000))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port")


class RedisServer:
    """A real redis-server on a free loopback port, with no persistence, for one test scope."""

    def __init__(self, port: int | None = None, *extra: str):
        import shutil

        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed; run .ci/run or apt-get install redis-server")
        if port is None:
            port = free_port()
        self.port, self.extra, self.proc = port, extra, None
        self.url = f"redis://127.0.0.1:{port}/0"

    def start(self):
        import time

        import redis

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", *self.extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        for _ in range(200):               # up to 20 s: a loaded CI machine can be slow
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.1)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url
