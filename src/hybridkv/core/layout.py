"""The cache layout of one model: its block size and the groups of layers cached alike.

A layout is what gives stored bytes their meaning, so its fingerprint namespaces every
persistent tier: a changed layout misses instead of loading wrong bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum

from hybridkv.core.errors import HybridKVError

FORMAT_VERSION = 1


class GroupKind(str, Enum):
    """How a group is cached: token groups hold a page per block, state groups one page per
    kept boundary, scratch groups are never cached."""

    ATTENTION = "attention"
    SLIDING_WINDOW = "sliding_window"
    STATE = "state"
    SCRATCH = "scratch"

    def __str__(self) -> str:
        return self.value


KINDS = tuple(k.value for k in GroupKind)
TOKEN_KINDS = (GroupKind.ATTENTION, GroupKind.SLIDING_WINDOW)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor inside a page (optional detail; it enters the fingerprint)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Group:
    id: int
    kind: GroupKind
    page_bytes: int
    window_tokens: int | None = None
    layers: tuple[str, ...] = ()
    tensors: tuple[TensorSpec, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "kind", GroupKind(self.kind))   # accept the plain name too

    @property
    def cacheable(self) -> bool:
        return self.kind is not GroupKind.SCRATCH

    @property
    def is_token_group(self) -> bool:
        """Attention-like groups hold one page per block; state groups one per boundary."""
        return self.kind in TOKEN_KINDS


@dataclass(frozen=True)
class Layout:
    model: str
    block_tokens: int
    groups: tuple[Group, ...]
    max_model_len: int | None = None
    revision: str | None = None
    dtype: str | None = None
    tp_rank: int = 0
    tp_size: int = 1
    engine: str | None = None      # serving engine and version when its page format matters
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def group(self, group_id: int) -> Group:
        for g in self.groups:
            if g.id == group_id:
                return g
        raise KeyError(group_id)

    @property
    def cacheable_groups(self) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.cacheable)

    @property
    def block_bytes(self) -> int:
        """RAM one block takes: a page of every token group."""
        return sum(g.page_bytes for g in self.groups if g.cacheable and g.is_token_group)

    @property
    def state_bytes(self) -> int:
        """RAM one kept state takes: a page of every state group."""
        return sum(g.page_bytes for g in self.groups if g.kind is GroupKind.STATE)

    def fingerprint(self) -> str:
        """Stable digest of everything that changes what the stored bytes mean."""
        identity = {
            "format": FORMAT_VERSION,
            "model": self.model,
            "revision": self.revision,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
            "tp": [self.tp_rank, self.tp_size],
            **({"engine": self.engine} if self.engine else {}),
            "groups": [
                {
                    "id": g.id, "kind": g.kind.value, "page_bytes": g.page_bytes,
                    "window_tokens": g.window_tokens, "layers": list(g.layers),
                    "tensors": [[t.name, list(t.shape), t.dtype] for t in g.tensors],
                }
                for g in self.groups
            ],
        }
        blob = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:24]

    def to_dict(self) -> dict:
        out: dict = {"model": self.model, "block_tokens": self.block_tokens}
        for name in ("max_model_len", "revision", "dtype", "engine"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.tp_size != 1 or self.tp_rank != 0:
            out["tp_rank"], out["tp_size"] = self.tp_rank, self.tp_size
        groups = []
        for g in self.groups:
            d: dict = {"id": g.id, "kind": g.kind.value, "page_bytes": g.page_bytes}
            if g.window_tokens is not None:
                d["window_tokens"] = g.window_tokens
            if g.layers:
                d["layers"] = list(g.layers)
            if g.tensors:
                d["tensors"] = [
                    {"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in g.tensors
                ]
            groups.append(d)
        out["groups"] = groups
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _positive_int(value, where: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HybridKVError(f"{where} must be a positive integer, got {value!r}; {fix}")
    return value


def _parse_group(raw, index: int) -> Group:
    where = f"groups[{index}]"
    if not isinstance(raw, dict):
        raise HybridKVError(f"{where} must be an object with id, kind and page_bytes")
    if "id" not in raw or isinstance(raw["id"], bool) or not isinstance(raw["id"], int) or raw["id"] < 0:
        raise HybridKVError(f"{where}.id must be a non-negative integer, got {raw.get('id')!r}")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise HybridKVError(f"{where}.kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
    page_bytes = _positive_int(
        raw.get("page_bytes"), f"{where}.page_bytes", "give the bytes of one page of this group"
    )
    window = raw.get("window_tokens")
    if kind == GroupKind.SLIDING_WINDOW:
        window = _positive_int(window, f"{where}.window_tokens", "sliding_window groups need their window")
    elif window is not None:
        raise HybridKVError(
            f"{where}.window_tokens is set on a {kind!r} group; only sliding_window groups have a window"
        )
    layers = raw.get("layers", [])
    if not isinstance(layers, list) or not all(isinstance(n, str) for n in layers):
        raise HybridKVError(f"{where}.layers must be a list of layer names")
    tensors = []
    for j, t in enumerate(raw.get("tensors", [])):
        try:
            tensors.append(TensorSpec(str(t["name"]), tuple(int(d) for d in t["shape"]), str(t["dtype"])))
        except (KeyError, TypeError, ValueError):
            raise HybridKVError(
                f"{where}.tensors[{j}] must be {{\"name\", \"shape\": [ints], \"dtype\"}}"
            ) from None
    unknown = set(raw) - {"id", "kind", "page_bytes", "window_tokens", "layers", "tensors"}
    if unknown:
        raise HybridKVError(f"{where} has unknown field(s) {sorted(unknown)}; remove them")
    return Group(raw["id"], kind, page_bytes, window, tuple(layers), tuple(tensors))


def layout_from_dict(raw) -> Layout:
    """Validate a layout object; every error names the field and the fix."""
    if not isinstance(raw, dict):
        raise HybridKVError("layout must be a JSON object with model, block_tokens and groups")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise HybridKVError("layout.model must be a non-empty string naming the model")
    block_tokens = _positive_int(raw.get("block_tokens"), "layout.block_tokens", "e.g. 64 or 784")
    max_len = raw.get("max_model_len")
    if max_len is not None:
        max_len = _positive_int(max_len, "layout.max_model_len", "or leave it out")
    raw_groups = raw.get("groups")
    if not isinstance(raw_groups, list) or not raw_groups:
        raise HybridKVError("layout.groups must be a non-empty list of groups")
    groups = tuple(_parse_group(g, i) for i, g in enumerate(raw_groups))
    seen: set[int] = set()
    for g in groups:
        if g.id in seen:
            raise HybridKVError(f"layout.groups: duplicate group id {g.id}; give every group its own id")
        seen.add(g.id)
    tp_size = _positive_int(raw.get("tp_size", 1), "layout.tp_size", "or leave it out")
    tp_rank = raw.get("tp_rank", 0)
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise HybridKVError(f"layout.tp_rank must be in [0, tp_size={tp_size}), got {tp_rank!r}")
    known = {"model", "block_tokens", "max_model_len", "revision", "dtype", "tp_rank", "tp_size", "engine", "groups"}
    extra = {k: v for k, v in raw.items() if k not in known}
    return Layout(
        model=model, block_tokens=block_tokens, groups=groups, max_model_len=max_len,
        revision=raw.get("revision"), dtype=raw.get("dtype"), tp_rank=tp_rank, tp_size=tp_size,
        engine=raw.get("engine"), extra=extra,
    )

