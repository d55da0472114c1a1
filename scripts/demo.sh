#!/usr/bin/env bash
# The main job: set-up of .venv (not the vLLM environment), then the demo scenario (extra
# arguments go to `hybridkv demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --main
exec .venv/bin/hybridkv demo "$@"
