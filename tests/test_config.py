import pytest

from hybridkv.config import CacheConfig, load_config, parse_retention
from hybridkv.core.errors import HybridKVError
from hybridkv.core.sizes import parse_size


@pytest.mark.parametrize("text, expected", [
    ("4GiB", 4 * 1024**3), ("512MB", 512 * 1000**2), ("1.5 GiB", int(1.5 * 1024**3)),
    ("1048576", 1048576), (4096, 4096), ("10k", 10000), ("2mib", 2 * 1024**2),
])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text, fragment", [
    ("4XB", "unknown unit"), ("-3GiB", "cannot read"), ("lots", "cannot read"), (True, "expected a size"),
])
def test_bad_sizes(text, fragment):
    with pytest.raises(HybridKVError, match=fragment):
        parse_size(text, "ram_bytes")


def test_file_env_and_overrides_precedence(tmp_path):
    toml = tmp_path / "cache.toml"
    toml.write_text('block_tokens = 128\nram_bytes = "1GiB"\neviction = "arc"\nretention = "dense"\n')
    cfg = load_config(toml, environ={})
    assert (cfg.block_tokens, cfg.ram_bytes, cfg.eviction, cfg.retention) == (128, 1024**3, "arc", None)
    cfg = load_config(toml, environ={"HYBRIDKV_RAM_BYTES": "2GiB", "HYBRIDKV_RETENTION": "1024"})
    assert cfg.ram_bytes == 2 * 1024**3 and cfg.retention == 1024
    cfg = load_config(toml, overrides={"ram_bytes": "64MiB", "eviction": None},
                      environ={"HYBRIDKV_RAM_BYTES": "2GiB"})
    assert cfg.ram_bytes == 64 * 1024**2 and cfg.eviction == "arc"


def test_switches_read_from_file_and_environment(tmp_path):
    toml = tmp_path / "cache.toml"
    toml.write_text("spare_states = false\n")
    assert load_config(toml, environ={}).spare_states is False
    assert load_config(toml, environ={"HYBRIDKV_SPARE_STATES": "on"}).spare_states is True
    assert load_config(environ={}).spare_states is True


def test_json_config(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"store": "/tmp/x", "fs_bytes": "10GB", "remote": "redis://127.0.0.1:1/0"}')
    cfg = load_config(path, environ={})
    assert cfg.store == "/tmp/x" and cfg.fs_bytes == 10 * 1000**3 and cfg.remote.endswith(":1/0")


@pytest.mark.parametrize("overrides, fragment", [
    ({"retention": 100}, "not a multiple of block_tokens 64"),
    ({"eviction": "fifo"}, "eviction 'fifo' is unknown"),
    ({"insertion": "mru"}, "insertion = 'mru' is unknown; use adaptive"),
    ({"ram_bytes": "0"}, "ram_bytes must be > 0"),
    ({"block_tokens": "x"}, "block_tokens: expected an integer"),
    ({"durability": "maybe"}, "durability 'maybe'"),
    ({"remote": "http://x"}, "not a Redis URL"),
    ({"reference_tokens": 10}, "shorter than one block"),
    ({"colour": "red"}, "unknown config setting(s) ['colour']"),
    ({"retention": "sometimes"}, "retention: cannot read"),
    ({"remote_timeout_s": float("nan")}, "remote_timeout_s must be a finite number"),
    ({"remote_timeout_s": "inf"}, "remote_timeout_s must be a finite number"),
    ({"remote_timeout_s": 0}, "remote_timeout_s must be a finite number"),
    ({"remote_ttl_s": -5}, "remote_ttl_s must be > 0"),
    ({"remote": "redis://[bad"}, "remote URL is malformed"),
    ({"remote": "redis://host:notaport/0"}, "remote URL is malformed"),
    ({"state_align": "sometimes"}, "state_align: 'sometimes' is invalid; use auto"),
    ({"state_align": -64}, "state_align: -64 is invalid"),
    ({"state_align": 96}, "state_align 96 is not a multiple of block_tokens 64"),
    ({"spare_states": "maybe"}, "spare_states: 'maybe' is not a switch; use true or false"),
])
def test_config_errors(overrides, fragment):
    with pytest.raises(HybridKVError) as info:
        load_config(overrides=overrides, environ={})
    assert fragment in str(info.value)


def test_malformed_config_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("block_tokens = = 3")
    with pytest.raises(HybridKVError, match="malformed"):
        load_config(path, environ={})


def test_retention_parsing():
    assert parse_retention("dense") is None and parse_retention("0") == 0
    assert parse_retention(512) == 512
    with pytest.raises(HybridKVError):
        parse_retention(-64)
    assert parse_retention("Auto") == "auto"


def test_default_retention_is_a_state_every_16k_tokens_on_any_block_size():
    config = CacheConfig()
    assert config.retention == "auto" and config.retention_tokens(64) == 16384   # 64 divides it
    assert config.retention_tokens(544) == 30 * 544       # the nearest multiple, 16,320
    assert config.retention_tokens(40000) == 40000        # one block at the least
    assert CacheConfig(retention=0).retention_tokens(256) == 0
    assert CacheConfig(retention="dense").retention_tokens(256) is None
    # 'auto' stays auto: another block size later resolves anew instead of failing
    assert config.replace(block_tokens=528).retention_tokens(528) == 31 * 528
    with pytest.raises(HybridKVError, match="use auto, 0, dense"):
        CacheConfig(retention=16384).replace(block_tokens=528)


def test_state_align_is_learned_unless_given():
    assert CacheConfig().state_align is None
    assert load_config(overrides={"state_align": "auto"}, environ={}).state_align is None
    assert load_config(environ={"HYBRIDKV_STATE_ALIGN": "512"}).state_align == 512
    assert load_config(overrides={"state_align": 0}, environ={}).state_align == 0
