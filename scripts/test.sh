#!/usr/bin/env bash
# The whole test suite: set-up, lint, the main pytest suite (it starts its own redis-server),
# then the vLLM connector's tests in .venv-vllm (real vLLM engines and `vllm serve`).
# Arguments go to the main suite; run one vLLM test with .venv-vllm/bin/python -m pytest tests/integrations/vllm/...
# Each suite runs on HYBRIDKV_TEST_WORKERS processes (default 2: most tests wait on a child,
# a disk or one core); the vLLM tests of one family stay on one worker (they share engines).
set -euo pipefail
WORKERS=${HYBRIDKV_TEST_WORKERS:-2}
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests scripts
.venv/bin/python -m pytest -n "$WORKERS" --ignore=tests/integrations "$@"
.venv-vllm/bin/python -m pytest -n "$WORKERS" --dist loadgroup tests/integrations/vllm
