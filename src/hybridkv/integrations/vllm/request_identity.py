"""What besides its tokens tells two vLLM requests' pages apart: the cache salt, a LoRA
adapter's weights, multimodal inputs. Prompts that differ in any of these never share a page."""

from __future__ import annotations

import os

from hybridkv.identity import checkpoint_revision


def request_identity(request) -> tuple[str | None, bytes | None]:
    """Salt (vLLM's ``cache_salt`` and the LoRA adapter) and extra key data (multimodal
    inputs): prompts that differ in any of these never share a page."""
    salt = getattr(request, "cache_salt", None) or ""
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        salt += f"|lora:{adapter_identity(lora)}"
    features = getattr(request, "mm_features", None) or []
    ids = [str(getattr(f, "identifier", None) or getattr(f, "mm_hash", "")) for f in features]
    extra = "|".join(ids).encode() if ids else None
    return salt or None, extra


_adapters: dict[tuple, str] = {}


def adapter_identity(lora) -> str:
    """A LoRA adapter by its weights, not its name: two servers sharing Redis with different
    weights under one adapter name must not share pages. A local adapter directory is named
    by a digest of its files, taken once per path and adapter id (vLLM keeps serving the
    weights it loaded under an id, so a lookup never goes back to the disk for it);
    otherwise the name, id and path are all there is."""
    path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
    if not (path and os.path.isdir(path)):
        return f"{lora.lora_name}:{lora.lora_int_id}:{path}"
    key = (os.path.realpath(path), lora.lora_int_id)
    if key not in _adapters:
        _adapters[key] = checkpoint_revision(path, extra_files=("adapter_config.json",))
    return _adapters[key]
