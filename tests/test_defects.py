"""Regression tests for error-path defects a review found; each failed before its fix."""

import errno
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import redis

import hybridkv
from hybridkv.config import CacheConfig
from hybridkv.engine.engine import Engine
from hybridkv.tiers import filesystem
from hybridkv.tiers.filesystem import FilesystemTier, page_path
from hybridkv.tiers.remote import RemoteTier, split_cluster_flag

from helpers import TESTS
from helpers.tier_worker import LAYOUT, key, page


def test_fs_read_error_is_a_miss_not_a_quarantine(tmp_path, monkeypatch):
    tier = FilesystemTier(tmp_path, LAYOUT, direct=False)
    assert tier.write(1, key(3), page(1, 3))
    out = np.empty(LAYOUT.group(1).page_bytes, np.uint8)

    def failing_readv(fd, buffers):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(filesystem.os, "readv", failing_readv)
    assert tier.read(1, key(3), out) is False
    assert tier.stats["read_errors"] == 1 and tier.stats["corrupt"] == 0
    assert page_path(tier.namespace, 1, key(3)).exists()     # the healthy page stays
    monkeypatch.undo()
    assert tier.read(1, key(3), out) and np.array_equal(out, page(1, 3))
    tier.close()


def test_redis_error_reply_on_read_is_a_miss(redis_url):
    tier = RemoteTier(redis_url, LAYOUT)
    assert tier.write_many([(1, key(5), page(1, 5))])
    names = tier.page_keys(1, key(5))
    client = redis.Redis.from_url(redis_url)
    client.delete(*names)
    for name in names:
        client.rpush(name, b"x")                # WRONGTYPE for GET / STRLEN
    out = np.empty(LAYOUT.group(1).page_bytes, np.uint8)
    assert tier.read_many([(1, key(5), out)]) == [False]
    assert tier.stats["errors"] >= 1
    tier.close()


def test_prefill_exception_releases_the_request(tmp_path, monkeypatch):
    with Engine("tiny-hybrid", CacheConfig(ram_dir=str(tmp_path), block_tokens=16)) as engine:
        prompt = list(range(3, 70))
        engine.generate(prompt, max_new_tokens=2)

        def out_of_memory(*args):               # what a real prefill may raise mid-request
            raise RuntimeError("CPU out of memory")

        monkeypatch.setattr(engine, "_prefill", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.generate(prompt + [5], max_new_tokens=2)   # a hit is pinned, then prefill fails
        assert engine.cache.stats()["open_requests"] == 0
        for gid, pool in engine.cache.pools.pools.items():
            assert all(pool.refs_of(k) == 0 for k in pool.resident_keys()), gid


def test_unclosed_cache_leaves_no_ram_files(tmp_path):
    script = textwrap.dedent(f"""
        from hybridkv.cache import TieredCache
        from hybridkv.config import CacheConfig
        from helpers.tier_worker import LAYOUT
        cache = TieredCache(LAYOUT, CacheConfig(ram_dir={str(tmp_path)!r}, ram_bytes="4MiB"))
        import os
        print(len(os.listdir({str(tmp_path)!r})))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=TESTS, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) > 0                 # regions existed while it ran
    assert list(tmp_path.iterdir()) == []       # and are gone after exit without close()


@pytest.mark.parametrize("url,clean,cluster", [
    ("redis://h:1/0?cluster=true", "redis://h:1/0", True),
    ("redis://h:1/0?db=2&cluster=1", "redis://h:1/0?db=2", True),
    ("redis://h:1/0?notcluster=true", "redis://h:1/0?notcluster=true", False),
    ("redis://h:1/0?cluster=false", "redis://h:1/0", False),
])
def test_cluster_flag_is_parsed_not_substring_matched(url, clean, cluster):
    assert split_cluster_flag(url) == (clean, cluster)


def test_engine_leaves_process_state_alone(tmp_path):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Engine("tiny-hybrid", CacheConfig(ram_dir=str(tmp_path)), use_cache=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_package_exports_what_the_readme_uses():
    for name in ("TieredCache", "Connector", "plan_pools", "CacheConfig", "Layout", "GroupKind"):
        assert hasattr(hybridkv, name), name
