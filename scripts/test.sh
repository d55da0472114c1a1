#!/usr/bin/env bash
# The whole test suite: set-up, lint, the main pytest suite (it starts its own redis-server),
# then the vLLM connector's tests in .venv-vllm (real vLLM engines and `vllm serve`).
# Arguments go to the main suite; run one vLLM test with .venv-vllm/bin/python -m pytest tests/integrations/vllm/...
# The main suite runs on HYBRIDKV_TEST_WORKERS processes (default 2: most tests wait on a child,
# a disk or one core) with one torch thread each (two workers with a thread per core each
# oversubscribe the cores: 125 s instead of 66 s here). The vLLM tests run serially: each engine
# binds its threads to every core, and on two cores two engines at once were slower than one
# after the other (249 s against 214 s, before the engine core ran in-process). A main-suite
# test takes seconds: --timeout 300 turns one that hangs (a redis cluster node dying under load
# left one sleeping in a client's retries) into a failure well inside a CI run's time, where the
# project-wide 900 s (sized for vLLM engine starts) would not.
set -euo pipefail
WORKERS=${HYBRIDKV_TEST_WORKERS:-2}
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests scripts
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m pytest -n "$WORKERS" --timeout 300 --ignore=tests/integrations "$@"
.venv-vllm/bin/python -m pytest tests/integrations/vllm
