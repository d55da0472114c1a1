#!/usr/bin/env bash
# The main job: set-up, then the demo scenario (extra arguments go to `hybridkv demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hybridkv demo "$@"
