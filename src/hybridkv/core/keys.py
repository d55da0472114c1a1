"""Chained block keys: ``h_i = H(h_{i-1} || tokens of block i || extra)``.

Deterministic across processes and machines (blake2b, no PYTHONHASHSEED, no randomness);
the salt isolates tenants, ``extra`` carries adapter ids or multimodal hashes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_TAG = b"hybridkv/1"
DIGEST_BYTES = 16


def root_hash(salt: bytes | str | None = None) -> bytes:
    if isinstance(salt, str):
        salt = salt.encode()
    return hashlib.blake2b(ROOT_TAG + b"\0" + (salt or b""), digest_size=DIGEST_BYTES).digest()


def block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_tokens: int,
    salt: bytes | str | None = None,
    extra: bytes | None = None,
    after: bytes | None = None,
) -> list[bytes]:
    """Hashes of every *full* block of ``tokens``; a ragged tail has no key. ``after`` (the
    key of the block before ``tokens``) continues a chain keyed a part at a time."""
    ids = np.asarray(tokens, dtype=np.int64)
    n_blocks = len(ids) // block_tokens
    raw = ids[: n_blocks * block_tokens].astype("<i8", copy=False).tobytes()
    step = block_tokens * 8
    tail = extra or b""
    prev = root_hash(salt) if after is None else after
    out = []
    blake = hashlib.blake2b
    for i in range(n_blocks):
        prev = blake(prev + raw[i * step:(i + 1) * step] + tail, digest_size=DIGEST_BYTES).digest()
        out.append(prev)
    return out
