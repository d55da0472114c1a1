#!/usr/bin/env bash
# The whole test suite: set-up, lint, then pytest (which starts its own redis-server).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests scripts
.venv/bin/python -m pytest "$@"
