"""The shared remote tier on Redis or Valkey (single node or cluster).

Pages are stored in the same self-checking format as on disk, in chunks
``<prefix>:{<fingerprint>:<group>:<key hex>}:p0``, ``...}:p1``, ...: the first holds the 64-byte
header and the payload's start, so a page of one chunk (any page up to ``CHUNK_BYTES``) is one
value, one GET and one SET. Chunks go straight between the RAM slot and the socket (no copy),
each page hashed just before it is sent and verified as soon as it landed; the hash tag keeps
a page in one cluster slot.
Existence checks, reads and writes are pipelined, one round trip per batch of up to
``PIPELINE_BYTES`` (redis-py parses huge pipelined replies slowly, so bigger batches are split).
When the server is unreachable the tier answers "miss", skips stores, retries with
exponential backoff and logs once per state change; it never raises into the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import Layout
from hybridkv.tiers import pagefile
from hybridkv.tiers.base import SecondaryTier, register_tier
from hybridkv.tiers.io_queue import READ, WRITE, IOQueue, fan_out
from hybridkv.tiers.resp import RawClient, RespError, raw_eligible

log = logging.getLogger(__name__)
CHUNK_BYTES = 32 * 1024 * 1024
PIPELINE_BYTES = 1024 * 1024   # measured best: redis-py copies large replies through BytesIO
RAW_PIPELINE_BYTES = 4 * 1024 * 1024   # measured: 8 MiB replies outgrew the caches (GET 64 KiB 0.84 vs 1.45 GB/s)
BACKOFF_START_S, BACKOFF_MAX_S = 0.25, 30.0
WRONG_SIZE = "payload size does not match the layout"


def _redis():
    try:
        import redis
    except ImportError:
        raise HybridKVError("the remote tier needs redis-py: pip install 'hybridkv[redis]'") from None
    return redis


def masked(url: str) -> str:
    """The URL without its password, for logs and reports."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def split_cluster_flag(url: str) -> tuple[str, bool]:
    """``(url without the cluster parameter, whether it asked for a cluster client)``."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    flags = [v for k, v in query if k == "cluster"]
    cluster = any(v.lower() in ("1", "true", "yes") for v in flags)
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    return urlunsplit(parts._replace(query=rest)), cluster


def _python_packer(pools) -> None:
    """Keep hiredis for replies (GETs 1.6-2.1x faster) but pack commands with redis-py's own
    packer: hiredis's copies every payload (``bytes(memoryview)``), which made 4 MiB SETs 4x
    slower; the Python one sends the RAM slot's memoryview as it is."""
    from redis import connection
    from redis._parsers.encoders import Encoder

    if not getattr(connection, "HIREDIS_AVAILABLE", False) or not hasattr(connection, "PythonRespSerializer"):
        return
    packer = connection.PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    for pool in pools:
        pool.connection_kwargs.setdefault("command_packer", packer)


def connect(url: str, timeout_s: float, python_packer: bool = True):
    """A client for ``url``; ``?cluster=true`` gives a cluster client."""
    redis = _redis()
    kwargs = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                  socket_read_size=1024 * 1024)
    try:
        clean, cluster = split_cluster_flag(url)
        if cluster:
            from redis.cluster import RedisCluster

            client = RedisCluster.from_url(clean, **kwargs)
            pools = [n.redis_connection.connection_pool for n in client.get_nodes() if n.redis_connection]
        else:
            client = redis.Redis.from_url(clean, **kwargs)
            pools = [client.connection_pool]
    except (ValueError, redis.RedisError) as e:
        raise HybridKVError(f"remote URL {masked(url)} is unusable: {e}") from None
    if python_packer:
        _python_packer(pools)
    return client


class RemoteTier(SecondaryTier):
    name = "remote"

    def __init__(self, url: str, layout: Layout, prefix: str = "hybridkv", ttl_s: int | None = None,
                 timeout_s: float = 0.5, threads: int = 2, chunk_bytes: int = CHUNK_BYTES,
                 clock=time.monotonic, python_packer: bool = True, raw: bool = True):
        self.url = url
        self.clock = clock              # the outage breaker's time source (tests inject one)
        self.layout = layout
        self.namespace = f"{prefix}:{{{layout.fingerprint()}"
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        self.chunk_bytes = chunk_bytes
        self._redis = _redis()
        self.client = connect(url, timeout_s, python_packer)
        # reads straight into the slots and writes from them on one node (resp.py)
        self.raw = RawClient(url, timeout_s) if raw and raw_eligible(url) else None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = BACKOFF_START_S
        self._down = False
        self.stats = {"reads": 0, "read_bytes": 0, "writes": 0, "write_bytes": 0, "corrupt": 0,
                      "skipped_stores": 0, "errors": 0, "outages": 0}
        self._io = IOQueue(threads, "hybridkv-remote")
        self._call(lambda: self.client.ping())      # report an unreachable server once, at start

    # -- keys and health ------------------------------------------------------------------
    def _chunks(self, group: int) -> int:
        return -(-self.layout.group(group).page_bytes // self.chunk_bytes)

    def page_keys(self, group: int, key: bytes) -> list[str]:
        """The page's chunks; the first carries the header and is written last."""
        base = f"{self.namespace}:{group}:{key.hex()}}}"
        return [f"{base}:p{i}" for i in range(self._chunks(group))]

    def _chunk_views(self, data: memoryview, chunks: int) -> list[memoryview]:
        return [data[i * self.chunk_bytes:(i + 1) * self.chunk_bytes] for i in range(chunks)]

    def _batches(self, items: list) -> list[list]:
        """Split items (group first) into pipelines of at most PIPELINE_BYTES (RAW_PIPELINE_BYTES
        on the slot path, which parses nothing it does not need)."""
        limit = RAW_PIPELINE_BYTES if self.raw is not None else PIPELINE_BYTES
        batches, current, size = [], [], 0
        for item in items:
            page = self.layout.group(item[0]).page_bytes
            if current and size + page > limit:
                batches.append(current)
                current, size = [], 0
            current.append(item)
            size += page
        if current:
            batches.append(current)
        return batches

    def available(self) -> bool:
        return self.clock() >= self._down_until

    @property
    def down(self) -> bool:
        """The last call could not reach the server (the tier serves misses until one can)."""
        return self._down

    def _call(self, fn, default=None):
        """Run one batch against the server; on connection trouble mark the tier down."""
        if not self.available():
            return default
        try:
            result = fn()
        except (self._redis.ConnectionError, self._redis.TimeoutError, OSError) as e:
            with self._lock:
                self.stats["errors"] += 1
                self._down_until = self.clock() + self._backoff
                self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)
                if not self._down:
                    self._down = True
                    self.stats["outages"] += 1
                    log.warning("remote tier %s unreachable (%s); serving misses, retrying with backoff",
                                masked(self.url), e)
            return default
        except (self._redis.RedisError, RespError) as e:
            # A server-side error reply (OOM, WRONGTYPE, a cluster move): this batch misses,
            # the server is reachable, so no backoff.
            with self._lock:
                self.stats["errors"] += 1
            log.warning("remote tier %s answered an error (%s); treated as a miss", masked(self.url), e)
            return default
        with self._lock:
            self._backoff = BACKOFF_START_S
            if self._down:
                self._down = False
                log.warning("remote tier %s is back", masked(self.url))
        return result

    # -- lookups --------------------------------------------------------------------------
    def contains_many(self, group: int, keys: list[bytes]) -> list[bool]:
        """One pipelined round trip: does the first chunk (written last) of each page exist?"""
        if not keys:
            return []

        def batch():
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.page_keys(group, k)[0])
            return [bool(n) for n in pipe.execute()]

        return self._call(batch, default=[False] * len(keys))

    def contains(self, group: int, key: bytes) -> bool:
        return self.contains_many(group, [key])[0]

    # -- reads ----------------------------------------------------------------------------
    def read_many(self, items: list[tuple[int, bytes, np.ndarray]]) -> list[bool]:
        """Fetch pages, one pipelined round trip per batch; verify each, delete bad ones."""
        results: list[bool] = []
        for batch in self._batches(items):
            results.extend(self._read_batch(batch))
        return results

    def _read_batch(self, items: list[tuple[int, bytes, np.ndarray]]) -> list[bool]:
        names = [name for group, key, _ in items for name in self.page_keys(group, key)]
        problems: list[str | None] = [None] * len(items)

        def fetch():
            if self.raw is not None:
                return self._fetch_into_slots(items, names, problems)
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return pipe.execute()

        values = self._call(fetch)
        if values is None:
            return [False] * len(items)
        results, pos, bad, read_bytes = [], 0, [], 0
        for n, (group, key, out) in enumerate(items):
            chunks = values[pos:pos + self._chunks(group)]
            pos += len(chunks)
            if chunks[0] is None:              # written last: the page is not (or no longer) there
                results.append(False)
                continue
            problem = "a chunk is missing" if None in chunks else (
                problems[n] if all(c is True for c in chunks) else self._copy_and_check(chunks, out, group, key))
            if problem is not None:
                log.warning("remote page %s is unusable (%s); deleted", key.hex(), problem)
                bad.append((group, key))
                results.append(False)
                continue
            results.append(True)
            read_bytes += out.nbytes
        with self._lock:
            self.stats["reads"] += results.count(True)
            self.stats["read_bytes"] += read_bytes
        if bad:
            with self._lock:
                self.stats["corrupt"] += len(bad)
            self._call(lambda: self.client.delete(*[n for g, k in bad for n in self.page_keys(g, k)]))
        return results

    def _fetch_into_slots(self, items: list[tuple[int, bytes, np.ndarray]], names: list[str],
                          problems: list[str | None]) -> list:
        """The slot path: each chunk straight into its part of the slot (the header into a
        buffer of its own), each page checked as soon as its last chunk landed, while its
        bytes are still in the CPU's caches; ``problems[n]`` says what is wrong with page n."""
        sinks: list = []
        headers = [bytearray(pagefile.HEADER_BYTES) for _ in items]
        last_chunk: dict[int, int] = {}         # a page's last chunk (value index) -> the page
        for n, (group, _, out) in enumerate(items):
            parts: list = self._chunk_views(memoryview(out).cast("B"), self._chunks(group))
            parts[0] = (memoryview(headers[n]), parts[0])
            sinks += parts
            last_chunk[len(sinks) - 1] = n

        def landed(index: int) -> None:
            n = last_chunk.get(index)
            if n is not None:
                group, key, out = items[n]
                problems[n] = self._problem(headers[n], out, group, key)

        return self.raw.get_into(names, sinks, landed)

    @staticmethod
    def _problem(header, out: np.ndarray, group: int, key: bytes) -> str | None:
        try:
            pagefile.verify(header, out, group, key)
        except pagefile.CorruptPage as e:
            return str(e)
        return None

    def _copy_and_check(self, chunks: list, out: np.ndarray, group: int, key: bytes) -> str | None:
        """Chunks that came back as bytes (redis-py, or a value of unexpected size): into the slot."""
        if any(c is True for c in chunks):         # some went into the slot, some did not fit it
            return WRONG_SIZE
        header, parts = chunks[0][:pagefile.HEADER_BYTES], [memoryview(chunks[0])[pagefile.HEADER_BYTES:], *chunks[1:]]
        if len(header) < pagefile.HEADER_BYTES or sum(len(c) for c in parts) != out.nbytes:
            return WRONG_SIZE
        offset = 0
        for part in parts:
            out[offset:offset + len(part)] = np.frombuffer(part, dtype=np.uint8)
            offset += len(part)
        return self._problem(header, out, group, key)

    def read(self, group: int, key: bytes, out: np.ndarray) -> bool:
        return self.read_many([(group, key, out)])[0]

    def submit_reads(self, items: list[tuple[int, bytes, np.ndarray]]) -> list[Future]:
        """One pipelined batch for all items; one future per item."""
        return fan_out(self._io.submit(READ, self.read_many, items), len(items))

    # -- writes ---------------------------------------------------------------------------
    def write_many(self, items: list[tuple[int, bytes, object]]) -> bool:
        """Store pages (SET with optional expiry), one pipelined round trip per batch."""
        return all([self._write_batch(batch) for batch in self._batches(items)])

    def _write_batch(self, items: list[tuple[int, bytes, object]]) -> bool:
        if not self.available():
            with self._lock:
                self.stats["skipped_stores"] += len(items)
            return False

        pairs, size = [], 0
        for group, key, payload in items:
            data = memoryview(payload).cast("B")
            names = self.page_keys(group, key)
            parts = self._chunk_views(data, len(names))
            # the first chunk last, with the header: a reader never finds the first chunk of a
            # write still under way; the header (a hash of the page) is made as it is sent
            pairs += list(zip(names[1:], parts[1:], strict=True))
            pairs.append((names[0], lambda g=group, k=key, d=data, p=parts[0]: (pagefile.make_header(g, k, d), p)))
            size += pagefile.HEADER_BYTES + len(data)

        def send():
            if self.raw is not None:
                self.raw.set_many(pairs, self.ttl_ms)
                return size
            pipe = self.client.pipeline(transaction=False)
            for name, value in pairs:
                pipe.set(name, b"".join(value()) if callable(value) else value, px=self.ttl_ms)
            pipe.execute()
            return size

        size = self._call(send)      # None: unreachable, or refused (e.g. OOM with noeviction)
        with self._lock:
            if size is None:
                self.stats["skipped_stores"] += len(items)
                return False
            self.stats["writes"] += len(items)
            self.stats["write_bytes"] += size
        return True

    def write(self, group: int, key: bytes, payload) -> bool:
        return self.write_many([(group, key, payload)])

    def submit_writes(self, items: list[tuple[int, bytes, object]]) -> list[Future]:
        batch = self._io.submit(WRITE, lambda: [self.write_many(items)] * len(items))
        return fan_out(batch, len(items))

    def close(self) -> None:
        self._io.close()
        if self.raw is not None:
            self.raw.close()
        try:
            self.client.close()
        except Exception:  # closing a dead connection must not fail a clean shutdown
            log.debug("remote client close failed", exc_info=True)


def inspect_remote(url: str, prefix: str = "hybridkv", timeout_s: float = 2.0) -> dict:
    """Pages and bytes per namespace under ``prefix`` (SCAN + pipelined STRLEN)."""
    redis = _redis()
    client = connect(url, timeout_s)
    namespaces: dict[str, dict] = {}
    try:
        names = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
        sizes = pipe.execute() if names else []
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise HybridKVError(f"cannot reach remote {masked(url)}: {e}; is the server running?") from None
    for name, size in zip(names, sizes, strict=True):
        text = name.decode() if isinstance(name, bytes) else name
        fingerprint = text.split("{", 1)[-1].split(":", 1)[0]
        ns = namespaces.setdefault(fingerprint, {"fingerprint": fingerprint, "keys": 0, "bytes": 0})
        ns["keys"] += 1
        ns["bytes"] += size
    return {"url": masked(url), "keys": sum(n["keys"] for n in namespaces.values()),
            "bytes": sum(n["bytes"] for n in namespaces.values()),
            "namespaces": sorted(namespaces.values(), key=lambda n: n["fingerprint"])}

register_tier("remote", "remote", lambda url, layout, config: RemoteTier(
    url, layout, prefix=config.remote_prefix, ttl_s=config.remote_ttl_s,
    timeout_s=config.remote_timeout_s))
