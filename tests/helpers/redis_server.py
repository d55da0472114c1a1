"""A real redis-server on a free loopback port, started and stopped by the tests."""

import random
import shutil
import socket
import subprocess
import time

import redis


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node its bus port (port + 10000) is free too: it
    lies in the range the kernel hands out to outgoing connections, and a node whose bus port
    is taken exits at once."""
    for _ in range(200):
        port = random.randrange(20000, 50000 if cluster else 60000)
        if all(_bindable(p) for p in ((port, port + 10000) if cluster else (port,))):
            return port
    raise RuntimeError("no free loopback port")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class RedisServer:
    """One redis-server with no persistence, for one test scope."""

    def __init__(self, port: int | None = None, *extra: str):
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed; run .ci/run or apt-get install redis-server")
        if port is None:
            port = free_port()
        self.port, self.extra, self.proc = port, extra, None
        self.url = f"redis://127.0.0.1:{port}/0"

    def start(self):
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", *self.extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        for _ in range(200):               # up to 20 s: a loaded CI machine can be slow
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start on port {self.port} (taken meanwhile?)")
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
