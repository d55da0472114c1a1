#!/usr/bin/env bash
# The whole test suite: set-up, lint, the main pytest suite (it starts its own redis-server),
# then the vLLM connector's tests in .venv-vllm (real vLLM engines and `vllm serve`).
# Arguments go to the main suite; run one vLLM test with .venv-vllm/bin/python -m pytest tests/vllm/...
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests scripts
.venv/bin/python -m pytest --ignore=tests/vllm "$@"
.venv-vllm/bin/python -m pytest tests/vllm
