"""Request traces a user replays through the simulator, read and written as JSON lines.

Two formats:

- ``mooncake``: ``{"timestamp", "input_length", "output_length", "hash_ids"}`` per line, the
  public Mooncake trace format. Each hash id names one block of ``trace_block_tokens`` prompt
  tokens (the last may be partial, per ``input_length``); equal ids mean equal tokens. Token ids
  are synthesized per hash id (a fixed function of the id and the position), so two requests
  share keys exactly as far as their id lists share a prefix.
- ``tokens``: ``{"prompt_ids": [...]}`` per line, optionally ``"session"``.

Every defect is a one-line ``HybridKVError`` naming the line and the fix; nothing is skipped
silently, because a trace with holes would report a hit rate that is not the traffic's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridkv.core.errors import HybridKVError

FORMATS = ("mooncake", "tokens")
MAX_LINE_BYTES = 16 * 1024 * 1024      # a longer line is a broken file, not a prompt
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceRequest:
    tokens: np.ndarray          # int64 prompt token ids
    session: str | None = None


def synthesized_tokens(hash_ids: np.ndarray, block_tokens: int, n_tokens: int) -> np.ndarray:
    """Token ids for a list of hash ids: a bijective 64-bit mix (splitmix64's finalizer) of
    ``id * block_tokens + position``, so different (id, position) pairs never collide before
    the final 31-bit cut and equal ids always give equal tokens."""
    ids = np.asarray(hash_ids, dtype=np.uint64)
    x = (ids[:, None] * np.uint64(block_tokens) + np.arange(block_tokens, dtype=np.uint64)).ravel()
    x = x[:n_tokens] + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x & np.uint64(0x7FFFFFFF)).astype(np.int64)


def _lines(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        f = path.open("rb")
    except OSError as e:
        raise HybridKVError(f"trace {path}: cannot open ({e.strerror}); check the path") from None
    with f:
        empty = True
        for number, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(line) > MAX_LINE_BYTES:
                raise HybridKVError(f"trace {path} line {number}: longer than {MAX_LINE_BYTES // 2**20} MiB; "
                                    "split the file into one JSON object per line")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise HybridKVError(f"trace {path} line {number}: not JSON ({e.msg}); "
                                    "write one JSON object per line") from None
            if not isinstance(record, dict):
                raise HybridKVError(f"trace {path} line {number}: a {type(record).__name__}, not an object; "
                                    "write one JSON object per line")
            empty = False
            yield number, record
        if empty:
            raise HybridKVError(f"trace {path} is empty; give a JSONL file with one request per line")


def _int_list(value, where: str, name: str) -> np.ndarray:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise HybridKVError(f"{where}: '{name}' must be a list of non-negative integers")
    if not value:
        raise HybridKVError(f"{where}: '{name}' is empty; every request needs a prompt")
    return np.asarray(value, dtype=np.int64)


def _mooncake(number: int, record: dict, where: str, block_tokens: int) -> TraceRequest:
    missing = [k for k in MOONCAKE_FIELDS if k not in record]
    if missing:
        raise HybridKVError(f"{where}: '{missing[0]}' is missing; each line needs "
                            f"{', '.join(MOONCAKE_FIELDS)}")
    ids = _int_list(record["hash_ids"], where, "hash_ids")
    n = record["input_length"]
    if type(n) is not int or not (len(ids) - 1) * block_tokens < n <= len(ids) * block_tokens:
        raise HybridKVError(f"{where}: input_length {n!r} does not fit {len(ids)} hash ids of "
                            f"{block_tokens} tokens; check --trace-block-tokens")
    return TraceRequest(synthesized_tokens(ids, block_tokens, n))


def _tokens(number: int, record: dict, where: str) -> TraceRequest:
    if "prompt_ids" not in record:
        raise HybridKVError(f"{where}: 'prompt_ids' is missing; each line needs a list of token ids")
    session = record.get("session")
    return TraceRequest(_int_list(record["prompt_ids"], where, "prompt_ids"),
                        None if session is None else str(session))


def read_trace(path: str | Path, fmt: str = "mooncake", block_tokens: int = 512) -> list[TraceRequest]:
    """Every request of a trace file, in file order, or a one-line error."""
    if fmt not in FORMATS:
        raise HybridKVError(f"trace format {fmt!r} is unknown; use {' or '.join(FORMATS)}")
    if block_tokens < 1:
        raise HybridKVError(f"trace block size {block_tokens} must be >= 1")
    path = Path(path)
    out = []
    for number, record in _lines(path):
        where = f"trace {path} line {number}"
        out.append(_mooncake(number, record, where, block_tokens) if fmt == "mooncake"
                   else _tokens(number, record, where))
    return out


def write_mooncake(path: str | Path, lines: Iterable[tuple[Sequence[int], int]], block_tokens: int = 512) -> int:
    """Write ``(hash ids, input_length)`` lines as a Mooncake trace. Returns how many."""
    n = 0
    with Path(path).open("w") as f:
        for n, (ids, length) in enumerate(lines, 1):
            f.write(json.dumps({"timestamp": n, "input_length": length, "output_length": 0,
                                "hash_ids": list(ids)}) + "\n")
    return n
