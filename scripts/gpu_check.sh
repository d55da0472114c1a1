#!/usr/bin/env bash
# The device check (python -m hybridkv.tools.gpu_check) on a GPU machine that has Python, torch
# and transformers but no network:
#   here:   bash scripts/gpu_check.sh --prepare       downloads the wheels of hybridkv's other
#                                                     dependencies (Python $GPU_PYTHON_VERSION, default 3.12) into .gpu-wheels/
#   there:  bash scripts/gpu_check.sh [FLAGS...]      runs the check from the source tree (the
#           compiled parts fall back to Python), FLAGS go to gpu_check; the JSON summary also
#           goes to $OUT/gpu_check.json when OUT is set
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--prepare" ]; then
  rm -rf .gpu-wheels
  "$PY" -m pip download -q -d .gpu-wheels --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "xxhash>=3.0" "tqdm>=4.60" "numpy>=1.26"
  ls .gpu-wheels
  exit 0
fi
[ -d .gpu-wheels ] || { echo "gpu_check.sh: no .gpu-wheels/; run 'bash scripts/gpu_check.sh --prepare' where there is network" >&2; exit 2; }
want="xxhash tqdm"
"$PY" -c "import numpy" 2>/dev/null || want="$want numpy"
"$PY" -m pip install -q --no-index --find-links .gpu-wheels --target .gpu-deps $want
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
PYTHONPATH="src:.gpu-deps${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m hybridkv.tools.gpu_check "$@" \
  | tee "${OUT:-/tmp}/gpu_check.json"
