"""The reference engine: chunked prefill with the cache attached, then greedy decoding.

Prefill always runs in B-token chunks from token 0 (cold or restored alike), which is what
makes a restored run bit-identical to a cold one; chunks therefore end at every boundary,
so junctions and retained boundaries need no special chunking.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridkv.cache import TieredCache
from hybridkv.config import CacheConfig
from hybridkv.connector import Connector
from hybridkv.core.errors import HybridKVError
from hybridkv.core.requests import all_token_ids, check_max_new_tokens, check_salt
from hybridkv.device.pinning import default_pin_hook
from hybridkv.engine.hf_cache import ATTENTION_GROUP, STATE_GROUP, HFCacheAdapter, RestoredCache
from hybridkv.engine.models import BUILTINS, ByteTokenizer, load_model, weights_digest
from hybridkv.identity import checkpoint_revision, software_versions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class GenerationResult:
    request: int
    prompt_tokens: int
    hit_tokens: int
    computed_tokens: int
    loaded_pages: dict[str, int]
    stored_pages: dict[str, int]
    junction: int | None
    output_token_ids: list[int]
    ttft_s: float
    restore_s: float = 0.0        # lookup + load + cache rebuild, inside ttft_s
    restored_bytes: int = 0
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def logits_digest(self) -> str:
        """sha256 of every logit produced: equal digests = bit-identical outputs, across processes."""
        h = hashlib.sha256()
        for row in self.logits:
            h.update(row.float().cpu().numpy().tobytes())
        return h.hexdigest()[:32]

    def to_dict(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k != "logits"}
        out["logits_digest"] = self.logits_digest
        return out


class Engine:
    """A hybrid model plus (optionally) a tiered prefix cache.

    >>> with Engine("tiny-hybrid", CacheConfig(store="/tmp/hkv")) as engine:
    ...     result = engine.generate("Hello", max_new_tokens=8)
    """

    def __init__(self, model: str = "tiny-hybrid", config: CacheConfig | None = None,
                 use_cache: bool = True, dtype: str = "float32", device: str = "cpu"):
        if dtype not in DTYPES:
            raise HybridKVError(f"dtype {dtype!r} is not supported; use float32 or bfloat16")
        try:
            self.device = torch.device(device)
            torch.empty(0, device=self.device)
        except (RuntimeError, AssertionError) as e:
            raise HybridKVError(f"device {device!r} is not usable here ({e}); use cpu") from None
        self.config = config or CacheConfig()
        self.model_name = model if model in BUILTINS else Path(model).name
        self.model, tokenizer = load_model(model, DTYPES[dtype])
        self.model.to(self.device)
        self.tokenizer = tokenizer or ByteTokenizer()
        revision = (weights_digest(self.model) if model in BUILTINS
                    else checkpoint_revision(model))
        self.adapter = HFCacheAdapter(self.model, self.config.block_tokens, self.model_name, revision,
                                      engine=software_versions("transformers", "torch"))
        self.layout = self.adapter.layout
        self.max_len = self.layout.max_model_len or 10**9
        self.cache: TieredCache | None = None
        self.connector: Connector | None = None
        if use_cache:
            self.cache = TieredCache(self.layout, self.config, pin_hook=default_pin_hook())
            self.connector = Connector(self.cache)
        self._ids = itertools.count()

    # -- the public call ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def check(self, prompt: str | list[int], max_new_tokens: int = 16, salt: str | None = None) -> list[int]:
        """The prompt's token ids, or a HybridKVError saying what is wrong with the request.

        Callers with many requests check them all first, so bad input never half-runs."""
        if isinstance(prompt, str):
            try:
                ids = self.encode(prompt)
            except UnicodeEncodeError:
                raise HybridKVError("the prompt is not valid UTF-8 text; re-encode it as UTF-8") from None
        elif all_token_ids(prompt):
            ids = list(prompt)
        else:
            raise HybridKVError("prompt token ids must all be integers")
        check_max_new_tokens(max_new_tokens)
        if not ids:
            raise HybridKVError("the prompt is empty; give at least one token")
        check_salt(salt)
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise HybridKVError(f"prompt token ids must be in [0, {vocab}) for {self.model_name}")
        if len(ids) + max_new_tokens > self.max_len:
            raise HybridKVError(
                f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens exceeds the model's "
                f"maximum length {self.max_len}; shorten the prompt"
            )
        return ids

    @torch.no_grad()
    def generate(self, prompt: str | list[int], max_new_tokens: int = 16, salt: str | None = None,
                 max_stored_tokens: int | None = None) -> GenerationResult:
        ids = self.check(prompt, max_new_tokens, salt)
        index = next(self._ids)
        conn = self.connector
        t0 = time.perf_counter()       # TTFT counts the hit lookup too
        # the load follows at once: its disk reads may start while the prompt is keyed
        req = conn.begin(f"r{index}-{id(self)}", ids, salt, max_stored_tokens, prefetch=True) if conn else None
        try:
            return self._run(index, ids, max_new_tokens, req, t0)
        finally:
            if req is not None:      # also on an exception: no pin outlives its request
                conn.finish(req)

    def _run(self, index: int, ids: list[int], max_new_tokens: int, req, t0: float) -> GenerationResult:
        conn = self.connector
        start, cache, restored_bytes = 0, None, 0
        if req is not None and req.hit_tokens:
            restored = RestoredCache(self.adapter, req.hit_tokens // self.adapter.B, self.device)
            views = conn.load(req, on_pages=restored.add)   # copied as the reads land
            if views is not None:
                state = views[STATE_GROUP][0] if STATE_GROUP in views else None
                cache = restored.build(len(views[ATTENTION_GROUP]), state)
                restored_bytes = sum(page.nbytes for pages in views.values() for page in pages)
                conn.release(req)
                start = req.hit_tokens
        restore_s = time.perf_counter() - t0
        if cache is None:
            cache = self.adapter.new_cache()
        logits = self._prefill(ids, start, cache, req)
        result_logits = [logits]
        token = int(logits.argmax())
        ttft = time.perf_counter() - t0
        out = [token]
        position = len(ids)
        for _ in range(max_new_tokens - 1):
            step = self.model(input_ids=torch.tensor([[token]], device=self.device),
                              position_ids=torch.tensor([[position]], device=self.device),
                              cache=cache, use_cache=True, logits_to_keep=1)
            logits = step.logits[0, -1].float()
            result_logits.append(logits)
            token = int(logits.argmax())
            out.append(token)
            position += 1
        return GenerationResult(
            request=index, prompt_tokens=len(ids), hit_tokens=start,
            computed_tokens=len(ids) - start,
            loaded_pages=(dict(req.sources) if start else dict.fromkeys(req.sources, 0)) if req else {},
            stored_pages=dict(req.stored) if req else {},
            junction=req.junction if req else None, output_token_ids=out, ttft_s=ttft,
            restore_s=restore_s, restored_bytes=restored_bytes, logits=result_logits,
        )

    def _prefill(self, ids: list[int], start: int, cache, req) -> torch.Tensor:
        B, conn, n = self.adapter.B, self.connector, len(ids)
        tokens = torch.tensor([ids], device=self.device)
        logits = None
        for s in range(start, n, B):
            e = min(s + B, n)
            out = self.model(input_ids=tokens[:, s:e], position_ids=torch.arange(s, e, device=self.device)[None],
                             cache=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1].float()
            if req is not None and e % B == 0:
                block = e // B - 1
                if conn.wants_block(req, block):
                    conn.offer_block(req, block, {ATTENTION_GROUP: self.adapter.attention_page(cache, block)})
                if conn.wants_state(req, e):
                    conn.offer_state(req, e, {STATE_GROUP: self.adapter.state_page(cache)})
                conn.step(req)
        return logits

    # -- figures and lifecycle ------------------------------------------------------------
    def stats(self) -> dict:
        if self.cache is None:
            return {}
        return {**self.cache.stats(), "connector": dict(self.connector.stats)}

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
