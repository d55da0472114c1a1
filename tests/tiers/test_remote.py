"""The Redis tier against a real redis-server on loopback."""

import json
import socket
import time

import numpy as np
import pytest
import redis

from hybridkv.cache import TieredCache, store_pages
from hybridkv.config import CacheConfig
from hybridkv.core.layout import layout_from_dict
from hybridkv.engine.engine import Engine
from hybridkv.tiers.remote import RemoteTier, masked
from hybridkv.tiers.resp import SEND_BYTES, RawClient

from helpers.cli import assert_one_line_error, cli, run_cli
from helpers.redis_server import RedisServer, free_port
from helpers.tier_worker import LAYOUT, key, load_now, page

B = 64


def ids(n, seed=0):
    return np.random.default_rng(seed).integers(3, 259, n).tolist()


def test_round_trip_batched_and_checked(redis_url):
    tier = RemoteTier(redis_url, LAYOUT)
    assert tier.write_many([(g, key(i), page(g, i)) for g in (0, 1) for i in range(5)])
    assert tier.contains_many(1, [key(0), key(4), key(9)]) == [True, True, False]
    outs = [np.empty(LAYOUT.group(1).page_bytes, np.uint8) for _ in range(3)]
    assert tier.read_many([(1, key(i), out) for i, out in zip((0, 4, 9), outs, strict=True)]) == [True, True, False]
    assert np.array_equal(outs[1], page(1, 4))
    tier.close()


def test_commands_carry_the_slot_itself_even_with_hiredis(redis_url):
    """hiredis (a dependency of the redis extra) parses replies; its command packer would copy
    every payload, so commands are packed by redis-py's, which passes the memoryview through."""
    from redis.utils import HIREDIS_AVAILABLE

    assert HIREDIS_AVAILABLE                      # installed with hybridkv[redis] / [dev]
    tier = RemoteTier(redis_url, LAYOUT)
    payload = memoryview(page(1, 2))
    pool = tier.client.connection_pool
    conn = pool.get_connection()
    try:
        packed = conn.pack_command("SET", "k", payload)
    finally:
        pool.release(conn)
    assert any(chunk is payload for chunk in packed)
    assert tier.write(1, key(2), page(1, 2))
    out = np.empty(LAYOUT.group(1).page_bytes, np.uint8)
    assert tier.read(1, key(2), out) and np.array_equal(out, page(1, 2))
    tier.close()


def test_a_page_of_one_chunk_is_one_value_holding_header_and_payload(redis_url):
    tier = RemoteTier(redis_url, LAYOUT)
    (name,) = tier.page_keys(1, key(4))
    assert tier.write(1, key(4), page(1, 4))
    value = redis.Redis.from_url(redis_url).get(name)
    assert value[:4] == b"HKVP" and value[64:] == page(1, 4).tobytes()
    tier.close()


def test_slot_client_hands_each_value_over_as_it_lands_and_makes_values_as_it_sends(redis_url, monkeypatch):
    """What lets the tier hash a page while it is in the CPU's caches and while the server
    works on the page before it: ``landed(i)`` runs once value i is in its sink, before the
    next reply is read; a SET's value given as a function is made when its turn to be sent
    comes, after the values before it went out."""
    events = []
    real_sendmsg = socket.socket.sendmsg

    def recorded(sock, buffers, *args):
        events.append("send")
        return real_sendmsg(sock, buffers, *args)

    monkeypatch.setattr(socket.socket, "sendmsg", recorded)
    client = RawClient(redis_url, 5.0)
    size = SEND_BYTES + 1000                   # each value fills a send of its own

    def value(i):
        def make():
            events.append(f"make {i}")
            return (bytes([i + 1]) * 8, np.full(size, i + 1, np.uint8))     # one value of two buffers
        return make

    client.set_many([(f"resp-test:{i}", value(i)) for i in range(3)])
    makes = [events.index(f"make {i}") for i in range(3)]
    assert all("send" in events[a:b] for a, b in zip(makes, makes[1:], strict=False))   # value 0 out before value 1 is made
    heads = [bytearray(8) for _ in range(3)]
    bodies = [np.zeros(size, np.uint8) for _ in range(3)]
    seen = []

    def landed(i):
        seen.append((i, bytes(heads[i]) == bytes([i + 1]) * 8, [bool(b.any()) for b in bodies]))

    sinks = [(memoryview(h), memoryview(b)) for h, b in zip(heads, bodies, strict=True)]
    got = client.get_into([f"resp-test:{i}" for i in range(3)] + ["resp-test:none"], sinks + [None], landed)
    assert got == [True, True, True, None]
    assert seen == [(0, True, [True, False, False]), (1, True, [True, True, False]), (2, True, [True, True, True])]
    assert all((bodies[i] == i + 1).all() for i in range(3))
    client.close()


def test_slot_client_finishes_sends_the_kernel_takes_a_few_bytes_at_a_time(redis_url, monkeypatch):
    real_sendmsg = socket.socket.sendmsg

    def short(sock, buffers, *args):           # a send that stops inside its first buffer
        first = next(memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes)
        return real_sendmsg(sock, [first[:7]], *args)

    monkeypatch.setattr(socket.socket, "sendmsg", short)
    tier = RemoteTier(redis_url, LAYOUT, chunk_bytes=5000)
    assert tier.write_many([(1, key(i), page(1, i)) for i in range(2)])
    outs = [np.empty(LAYOUT.group(1).page_bytes, np.uint8) for _ in range(2)]
    assert tier.read_many([(1, key(i), out) for i, out in enumerate(outs)]) == [True, True]
    assert all(np.array_equal(outs[i], page(1, i)) for i in range(2))
    tier.close()


@pytest.mark.parametrize("raw", [True, False], ids=["slot-path", "redis-py"])
@pytest.mark.parametrize("where", ["header", "first-chunk-payload", "last-chunk"])
def test_a_damaged_chunk_is_a_miss_and_the_whole_page_is_deleted(redis_url, raw, where):
    tier = RemoteTier(redis_url, LAYOUT, chunk_bytes=5000, raw=raw)
    assert tier.write(1, key(8), page(1, 8))
    names = tier.page_keys(1, key(8))
    client = redis.Redis.from_url(redis_url)
    name, at = {"header": (names[0], 20), "first-chunk-payload": (names[0], 100), "last-chunk": (names[-1], 3)}[where]
    blob = bytearray(client.get(name))
    blob[at] ^= 0xFF
    client.set(name, bytes(blob))
    out = np.empty(LAYOUT.group(1).page_bytes, np.uint8)
    assert tier.read(1, key(8), out) is False
    assert tier.stats["corrupt"] == 1 and client.exists(*names) == 0
    tier.close()


def test_large_pages_are_chunked_within_one_slot(redis_url):
    tier = RemoteTier(redis_url, LAYOUT, chunk_bytes=5000)
    names = tier.page_keys(1, key(3))
    assert len(names) == 4 and len({n.split("{")[1].split("}")[0] for n in names}) == 1
    assert tier.write(1, key(3), page(1, 3))
    out = np.empty(LAYOUT.group(1).page_bytes, np.uint8)
    assert tier.read(1, key(3), out) and np.array_equal(out, page(1, 3))
    redis.Redis.from_url(redis_url).delete(names[2])          # one chunk evicted by the server
    assert not tier.read(1, key(3), out)
    assert not tier.contains(1, key(3))
    tier.close()


def test_corrupt_value_is_a_miss_and_deleted(redis_url):
    tier = RemoteTier(redis_url, LAYOUT)
    tier.write(0, key(1), page(0, 1))
    client = redis.Redis.from_url(redis_url)
    (name,) = tier.page_keys(0, key(1))          # one chunk: header and payload
    blob = bytearray(client.get(name))
    blob[-10] ^= 0xFF
    client.set(name, bytes(blob))
    out = np.empty(4096, np.uint8)
    assert tier.read(0, key(1), out) is False
    assert tier.stats["corrupt"] == 1 and not client.exists(name)
    tier.close()


def test_namespaces_of_two_layouts_are_isolated(redis_url):
    other = layout_from_dict({**LAYOUT.to_dict(), "dtype": "bfloat16"})
    a, b = RemoteTier(redis_url, LAYOUT), RemoteTier(redis_url, other)
    a.write(0, key(1), page(0, 1))
    assert a.contains(0, key(1)) and not b.contains(0, key(1))
    a.close()
    b.close()


def test_ttl_expires_pages(redis_url):
    tier = RemoteTier(redis_url, LAYOUT, ttl_s=1)
    tier.write(0, key(2), page(0, 2))
    server = redis.Redis.from_url(redis_url)
    assert 0 < server.pttl(tier.page_keys(0, key(2))[0]) <= 1000
    deadline = time.monotonic() + 10           # the server expires keys on its own clock
    while server.exists(tier.page_keys(0, key(2))[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tier.contains(0, key(2))
    tier.close()


def test_server_down_at_start_gives_misses_not_errors():
    server = RedisServer()                 # a free port with nothing listening
    tier = RemoteTier(server.url, LAYOUT, timeout_s=0.2)
    assert tier.contains_many(0, [key(1), key(2)]) == [False, False]
    assert tier.write(0, key(1), page(0, 1)) is False
    # One failed call opened the breaker; the write behind it did not try the network again.
    assert tier.stats["outages"] == 1 and tier.stats["skipped_stores"] >= 1
    tier.close()


@pytest.mark.long
def test_two_engine_processes_share_one_redis(redis_url, tmp_path):
    prompt = tmp_path / "p.json"
    prompt.write_text(json.dumps(ids(4 * B + 9, seed=21)))
    common = ["generate", "--prompt-ids", prompt, "--remote", redis_url, "--max-new-tokens", "5", "--json"]
    first = run_cli(*common, "--store", tmp_path / "host1")
    second = run_cli(*common, "--store", tmp_path / "host2")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    one, two = json.loads(first.stdout), json.loads(second.stdout)
    assert one["hit_tokens"] == 0
    assert two["hit_tokens"] == 4 * B and two["loaded_pages"]["remote"] == 5
    assert two["output_token_ids"] == one["output_token_ids"]
    assert two["logits_digest"] == one["logits_digest"]
    info = json.loads(cli("inspect", "--remote", redis_url, "--json").stdout)["remote"]
    assert info["keys"] >= 5 and info["bytes"] > 0


def test_server_killed_mid_run_then_back(tmp_path):
    server = RedisServer().start()
    cfg = CacheConfig(block_tokens=B, remote=server.url, remote_timeout_s=0.2, ram_bytes="2MiB",
                      reference_tokens=8 * B)
    prompts = [ids(3 * B + 5, seed) for seed in range(4)]
    cold = Engine("tiny-hybrid", cfg, use_cache=False)
    with Engine("tiny-hybrid", cfg) as engine:
        engine.generate(prompts[0], 3)
        engine.cache.drain()
        server.stop()
        for p in prompts[1:3]:                      # requests keep completing, same output
            r = engine.generate(p, 3)
            assert r.output_token_ids == cold.generate(p, 3).output_token_ids
        engine.cache.drain()
        remote = next(t for t in engine.cache.secondaries if t.name == "remote")
        assert remote.stats["outages"] == 1
        server.start()
        remote.clock = lambda: time.monotonic() + 60   # the breaker's backoff has passed
        deadline = time.time() + 10
        while not remote.contains(0, b"\0" * 16) and remote.down and time.time() < deadline:
            time.sleep(0.2)
        r = engine.generate(prompts[3], 3)
        engine.cache.drain()
        assert not remote.down
    with Engine("tiny-hybrid", cfg) as engine:      # a new engine finds prompt 3 in Redis
        again = engine.generate(prompts[3], 3)
    server.stop()
    assert again.hit_tokens == 3 * B and again.loaded_pages["remote"] == 4
    assert again.output_token_ids == r.output_token_ids


def test_tiering_order_ram_fs_remote(redis_url, tmp_path):
    cfg = CacheConfig(block_tokens=16, ram_bytes="1MiB", store=str(tmp_path), remote=redis_url)
    with TieredCache(LAYOUT, cfg) as cache:
        store_pages(cache, {1: [(key(5), page(1, 5))]})
    assert [t.name for t in TieredCache(LAYOUT, cfg.replace(store=None)).secondaries] == ["remote"]
    with TieredCache(LAYOUT, cfg.replace(store=str(tmp_path / "empty"))) as cache:
        assert cache.lookup(1, [key(5)]) == ["remote"]
        _, views = load_now(cache, {1: [key(5)]})
        assert np.array_equal(views[1][0], page(1, 5))


def test_bad_remote_url_and_masking():
    assert masked("redis://user:secret@h:1/0") == "redis://user:***@h:1/0"
    assert_one_line_error(cli("generate", "--prompt", "x", "--remote", "http://h"), "not a Redis URL")
    proc = cli("inspect", "--remote", RedisServer().url)
    assert_one_line_error(proc, "cannot reach remote")


@pytest.mark.parametrize("policy", ["noeviction"])
def test_maxmemory_reached_skips_stores(tmp_path, policy):
    server = RedisServer(None, "--maxmemory", "2mb", "--maxmemory-policy", policy).start()
    try:
        tier = RemoteTier(server.url, LAYOUT, timeout_s=10)   # no outage on a loaded machine
        results = [tier.write(1, key(i), page(1, i)) for i in range(400)]
        assert results[0] is True and results[-1] is False
        assert tier.stats["skipped_stores"] > 0 and tier.stats["outages"] == 0
        tier.close()
    finally:
        server.stop()


def wait_for_cluster(ports: list[int], timeout_s: float = 30) -> None:
    """Every node must see every node and all 16384 slots served, not just the first node:
    a client routed to a node still joining gets MOVED/CLUSTERDOWN."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = [redis.Redis(port=p).cluster("info") for p in ports]
        if all(i.get("cluster_state") == "ok" and int(i.get("cluster_known_nodes", 0)) == len(ports)
               and int(i.get("cluster_slots_ok", 0)) == 16384 for i in infos):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"redis cluster not ready after {timeout_s} s: {infos}")
        time.sleep(0.1)


def test_redis_cluster_with_chunked_pages(tmp_path):
    import subprocess

    nodes = []
    try:
        for i in range(3):
            node_dir = tmp_path / f"n{i}"
            node_dir.mkdir()
            server = RedisServer(free_port(cluster=True), "--cluster-enabled", "yes", "--cluster-config-file",
                                 str(node_dir / "nodes.conf"), "--dir", str(node_dir))
            nodes.append(server.start())
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        wait_for_cluster([n.port for n in nodes])
        tier = RemoteTier(f"{nodes[0].url}?cluster=true", LAYOUT, chunk_bytes=5000)
        assert tier.write_many([(1, key(i), page(1, i)) for i in range(12)])
        assert tier.contains_many(1, [key(i) for i in range(14)]) == [True] * 12 + [False] * 2
        outs = [np.empty(16384, np.uint8) for _ in range(12)]
        assert tier.read_many([(1, key(i), outs[i]) for i in range(12)]) == [True] * 12
        assert all(np.array_equal(outs[i], page(1, i)) for i in range(12))
        tier.close()
    finally:
        for n in nodes:
            n.stop()


def _password_server(tmp_path):
    """A redis-server that wants a password, on TCP and a unix socket."""
    import subprocess

    port, sock = free_port(), str(tmp_path / "redis.sock")
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--requirepass", "s3cret", "--unixsocket", sock],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password="s3cret", socket_connect_timeout=0.2)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            return proc, port, sock, client
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)


def test_slot_path_authenticates_selects_the_database_and_reads_what_redis_py_wrote(tmp_path):
    """Pages go straight between the slots and the socket (resp.py) over TCP with a password
    and a database, and over a unix socket; both paths read each other's pages."""
    proc, port, sock, client = _password_server(tmp_path)
    try:
        tcp = RemoteTier(f"redis://:s3cret@127.0.0.1:{port}/3", LAYOUT, chunk_bytes=5000)
        plain = RemoteTier(f"redis://:s3cret@127.0.0.1:{port}/3", LAYOUT, chunk_bytes=5000, raw=False)
        unix = RemoteTier(f"unix://:s3cret@{sock}?db=3", LAYOUT, chunk_bytes=5000)
        assert tcp.raw is not None and plain.raw is None and unix.raw is not None
        assert tcp.write_many([(1, key(i), page(1, i)) for i in range(3)])      # 4 chunks a page
        assert plain.write_many([(1, key(i), page(1, i)) for i in range(3, 6)])
        assert redis.Redis(port=port, password="s3cret", db=3).exists(*tcp.page_keys(1, key(0))) == 4
        assert not client.exists(tcp.page_keys(1, key(0))[0])                 # not in database 0
        for reader in (tcp, plain, unix):
            outs = [np.empty(LAYOUT.group(1).page_bytes, np.uint8) for _ in range(7)]
            got = reader.read_many([(1, key(i), out) for i, out in enumerate(outs)])
            assert got == [True] * 6 + [False]
            assert all(np.array_equal(outs[i], page(1, i)) for i in range(6))
        for tier in (tcp, plain, unix):
            tier.close()
        wrong = RemoteTier(f"redis://:nope@127.0.0.1:{port}/3", LAYOUT)      # an outage, not an error per call
        out = np.empty(LAYOUT.group(1).page_bytes, np.uint8)
        assert not wrong.write(1, key(9), page(1, 9)) and not wrong.read(1, key(0), out)
        assert wrong.stats["outages"] == 1
        wrong.close()
    finally:
        proc.kill()
        proc.wait()


def test_slot_path_refuses_a_value_of_the_wrong_size_as_corrupt(redis_url):
    tier = RemoteTier(redis_url, LAYOUT)
    assert tier.write(0, key(7), page(0, 7))
    (name,) = tier.page_keys(0, key(7))
    redis.Redis.from_url(redis_url).set(name, b"short")          # another writer's truncated value
    out = np.empty(LAYOUT.group(0).page_bytes, np.uint8)
    assert not tier.read(0, key(7), out) and tier.stats["corrupt"] == 1
    assert not tier.contains(0, key(7))                            # deleted: never served
    tier.close()
