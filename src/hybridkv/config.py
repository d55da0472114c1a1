"""One configuration object for the whole cache, from a TOML/JSON file, the environment
(``HYBRIDKV_<FIELD>``) and CLI flags, in that order of precedence (flags win).

Everything is validated here, at start-up, so a bad value fails before any byte is stored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from hybridkv.core.errors import HybridKVError
from hybridkv.core.insertion import check_mode
from hybridkv.core.layout import Layout, layout_from_dict
from hybridkv.core.retention import AUTO, resolve_interval
from hybridkv.core.sizes import parse_size
from hybridkv.ram.policies import POLICIES

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DURABILITY = ("none", "fsync")


def parse_retention(value) -> int | str | None:
    """``dense``/``none`` -> None (a state at every boundary); ``auto`` -> ``AUTO`` (resolved
    against the block size by ``resolve_interval``); else tokens >= 0."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("dense", "none", "null"):
            return None
        if text == AUTO:
            return AUTO
        try:
            value = int(text)
        except ValueError:
            raise HybridKVError(
                f"retention: cannot read {value!r}; use auto, dense, 0 (semantic) or a token interval"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HybridKVError(f"retention: {value!r} is invalid; use auto, dense, 0 or a positive interval")
    return value


def parse_state_align(value) -> int | None:
    """``auto`` -> None (learned from the traffic); else tokens >= 0 (0: the replay boundary)."""
    text = str(value).strip().lower()
    if value is None or text == "auto":
        return None
    if isinstance(value, bool) or not text.isdecimal():
        raise HybridKVError(f"state_align: {value!r} is invalid; use auto, 0 (the replay boundary) "
                            "or a token count such as 512")
    return int(text)


def parse_bool(value, name: str) -> bool:
    """A switch from a file (true/false) or text (true/false, yes/no, on/off, 1/0)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise HybridKVError(f"{name}: {value!r} is not a switch; use true or false")


def setting(default, help: str):
    """A config field; ``help`` is its documentation and the text of its CLI flag."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class CacheConfig:
    """Every setting of the cache. The CLI makes one ``--flag`` per field, the environment one
    ``HYBRIDKV_<FIELD>``; all of them are validated here and nowhere else."""

    block_tokens: int = setting(64, "tokens per block (default 64)")
    ram_bytes: int = setting(256 * 1024**2, "RAM tier budget per worker, e.g. 4GiB (default 256MiB)")
    eviction: str = setting("lru", f"RAM eviction policy: {' or '.join(POLICIES)} (default lru)")
    ram_split: str = setting("shared", "how RAM divides between attention pages and states: shared (default: one arena whose segments move to the kind whose least recently used page is younger; lru only) or static (as planned for reference_tokens)")
    insertion: str = setting("adaptive", "where new pages enter RAM's eviction order: adaptive (default: learned from the traffic), warm (always recent, plain LRU) or cold (a request that found under half its prompt cached stores at the evicted-first end)")
    retention: int | str | None = setting(AUTO, "recurrent states kept besides each prompt's own and the junctions: auto (default: one every ~16K tokens), 0 (none), every N tokens, or dense (one at every block)")
    spare_states: bool = setting(True, "also keep states the retention does not ask for while RAM has room for them: cold, never evicting a page, in RAM only until a hit uses one (default true)")
    tail_states: int = setting(1, "states also kept this many blocks before each prompt's end, for follow-ups that change its last block (default 1)")
    state_align: int | None = setting(None, "where each prompt's own state is kept: auto (default, learned from where prompts diverge), 0 (its replay boundary) or N (the deepest multiple of N tokens)")
    reference_tokens: int | None = setting(None, "typical request length the pools are sized for (default: the model's maximum)")
    engine_block_tokens: int | None = setting(None, "the serving engine's own block size, when it has one (checked against block_tokens)")
    ram_dir: str = setting("/dev/shm", "directory of the shared RAM regions, a tmpfs (default /dev/shm)")
    store: str | None = setting(None, "filesystem tier directory (persistent, survives restarts)")
    store_mode: str = setting("private", "private (default) or group: a store several users of one group share")
    fs_bytes: int | None = setting(None, "filesystem tier quota, e.g. 20GiB (default: unbounded)")
    durability: str = setting("none", "none (default) or fsync: every page on stable storage before it counts")
    remote: str | None = setting(None, "Redis/Valkey URL of a shared remote tier, e.g. redis://host:6379/0")
    remote_prefix: str = setting("hybridkv", "key prefix in the remote tier (default hybridkv)")
    remote_ttl_s: int | None = setting(None, "seconds a remote page lives (default: until Redis evicts it)")
    remote_timeout_s: float = setting(0.5, "seconds before a remote call counts as failed (default 0.5)")

    def __post_init__(self):
        for name in _FIELDS:  # accept "4GiB", "dense", "64" from library users too
            object.__setattr__(self, name, _coerce(name, getattr(self, name)))
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int) or self.block_tokens <= 0:
            raise HybridKVError(f"block_tokens must be a positive integer, got {self.block_tokens!r}")
        if self.ram_bytes <= 0:
            raise HybridKVError("ram_bytes must be > 0; give the RAM tier a budget such as 1GiB")
        if self.eviction not in POLICIES:
            raise HybridKVError(f"eviction {self.eviction!r} is unknown; use one of {', '.join(POLICIES)}")
        check_mode(self.insertion)
        if self.ram_split not in ("shared", "static"):
            raise HybridKVError(f"ram_split {self.ram_split!r} is unknown; use shared (the default) or static")
        if self.retention not in (None, AUTO) and self.retention % self.block_tokens:
            raise HybridKVError(
                f"retention {self.retention} is not a multiple of block_tokens {self.block_tokens}; "
                f"use auto, 0, dense or a multiple such as {self.block_tokens * 8}"
            )
        if isinstance(self.tail_states, bool) or not isinstance(self.tail_states, int) or self.tail_states < 0:
            raise HybridKVError(f"tail_states must be an integer >= 0, got {self.tail_states!r}")
        if self.state_align and self.state_align % self.block_tokens:
            raise HybridKVError(f"state_align {self.state_align} is not a multiple of block_tokens "
                                f"{self.block_tokens}; use auto, 0 or e.g. {2 * self.block_tokens}")
        if self.reference_tokens is not None and self.reference_tokens < self.block_tokens:
            raise HybridKVError(
                f"reference_tokens {self.reference_tokens} is shorter than one block "
                f"({self.block_tokens}); use a typical request length"
            )
        if self.engine_block_tokens is not None and self.engine_block_tokens <= 0:
            raise HybridKVError(f"engine_block_tokens must be > 0, got {self.engine_block_tokens}")
        if self.store_mode not in ("private", "group"):
            raise HybridKVError(f"store_mode {self.store_mode!r} is unknown; use private or group")
        if self.durability not in DURABILITY:
            raise HybridKVError(f"durability {self.durability!r} is unknown; use none or fsync")
        if self.fs_bytes is not None and self.fs_bytes <= 0:
            raise HybridKVError("fs_bytes must be > 0; or leave it out for an unbounded store")
        if self.remote is not None and not self.remote.startswith(("redis://", "rediss://", "unix://")):
            raise HybridKVError(
                f"remote {self.remote!r} is not a Redis URL; use redis://host:6379/0 or rediss://..."
            )
        if self.remote is not None:
            try:
                urlsplit(self.remote).port  # noqa: B018 (the property parses; raises on "[bad")
            except ValueError as e:
                raise HybridKVError(
                    f"remote URL is malformed ({e}); use redis://host:6379/0 or rediss://...") from None
        if not math.isfinite(self.remote_timeout_s) or self.remote_timeout_s <= 0:
            raise HybridKVError(
                f"remote_timeout_s must be a finite number of seconds > 0, got {self.remote_timeout_s!r}")
        if self.remote_ttl_s is not None and self.remote_ttl_s <= 0:
            raise HybridKVError(
                f"remote_ttl_s must be > 0 seconds, got {self.remote_ttl_s}; or leave it out to keep "
                "pages until Redis evicts them")

    def retention_tokens(self, block_tokens: int) -> int | None:
        """The retention interval for blocks of ``block_tokens`` (``auto`` resolved against the
        block the cache works in: the layout's, which a caller may pair with another config)."""
        return resolve_interval(self.retention, block_tokens)

    def replace(self, **changes) -> CacheConfig:
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name: f for f in dataclasses.fields(CacheConfig)}
_SIZE_FIELDS = ("ram_bytes", "fs_bytes")
_BOOL_FIELDS = ("spare_states",)
_INT_FIELDS = ("block_tokens", "tail_states", "reference_tokens", "engine_block_tokens", "remote_ttl_s")


def _coerce(name: str, value):
    """Turn file/env/flag text into the field's type with a message naming the field."""
    if value is None:
        return None
    if name in _SIZE_FIELDS:
        return parse_size(value, name)
    if name == "retention":
        return parse_retention(value)
    if name == "state_align":
        return parse_state_align(value)
    if name in _INT_FIELDS:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return int(str(value))
        except ValueError:
            raise HybridKVError(f"{name}: expected an integer, got {value!r}") from None
    if name in _BOOL_FIELDS:
        return parse_bool(value, name)
    if name == "remote_timeout_s":
        try:
            return float(value)
        except (TypeError, ValueError):
            raise HybridKVError(f"{name}: expected seconds, got {value!r}") from None
    return str(value)


def read_config_file(path: str | Path) -> dict:
    path = Path(path)
    data = read_input_file(path, "config file")
    try:
        raw = tomllib.loads(data.decode()) if path.suffix == ".toml" else json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise HybridKVError(f"config file {path} is malformed: {e}") from None
    if not isinstance(raw, dict):
        raise HybridKVError(f"config file {path} must hold a table/object of settings")
    return raw


def load_config(
    path: str | Path | None = None,
    overrides: dict | None = None,
    environ: dict | None = None,
) -> CacheConfig:
    """Merge file < environment < overrides (None values in overrides are ignored)."""
    values: dict = {}
    if path is not None:
        values.update(read_config_file(path))
    env = os.environ if environ is None else environ
    for name in _FIELDS:
        key = f"HYBRIDKV_{name.upper()}"
        if key in env:
            values[name] = env[key]
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = set(values) - set(_FIELDS)
    if unknown:
        raise HybridKVError(
            f"unknown config setting(s) {sorted(unknown)}; known: {', '.join(sorted(_FIELDS))}"
        )
    return CacheConfig(**values)


def read_input_file(path, what: str) -> bytes:
    """The bytes of a file the user named (a config, a layout), or a one-line error."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise HybridKVError(f"cannot read {what} {path}: {e.strerror}; check the path") from None


def load_layout(path: str | Path) -> Layout:
    path = Path(path)
    try:
        raw = json.loads(read_input_file(path, "layout file"))
    except json.JSONDecodeError as e:
        raise HybridKVError(
            f"layout file {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    except UnicodeDecodeError:
        raise HybridKVError(f"layout file {path} is not UTF-8 text; write it as JSON") from None
    return layout_from_dict(raw)
