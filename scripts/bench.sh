#!/usr/bin/env bash
# Regenerates docs/benchmarks.md, docs/bench.json and docs/img/*.png with one full run.
# A throwaway redis-server on a loopback port is started for the remote-tier figures when
# redis-server is installed. Pass --quick for the two-minute version. HYBRIDKV_TRACES names a
# directory of Mooncake-format traces (*.jsonl) the state-policy comparison replays as well;
# HYBRIDKV_VLLM_LOAD=1 also runs vllm serve under 16 clients with and without hybridkv (minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
remote=()
if command -v redis-server >/dev/null 2>&1; then
  port=6390
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
    --pidfile "/tmp/hybridkv-bench-redis.pid" >/dev/null
  trap 'kill "$(cat /tmp/hybridkv-bench-redis.pid)" 2>/dev/null || true' EXIT
  sleep 0.5
  remote=(--remote "redis://127.0.0.1:$port/0")
fi
mkdir -p docs/img
# Into a temp file first: a failed or interrupted run keeps the last good results.
.venv/bin/hybridkv bench "$@" "${remote[@]}" --plot docs/img --json > docs/bench.json.tmp
mv docs/bench.json.tmp docs/bench.json
.venv/bin/python -m hybridkv.tools.bench_lookup --out docs/bench_lookup.json   # about a minute
traces=()
if [ -n "${HYBRIDKV_TRACES:-}" ]; then traces=(--traces "$HYBRIDKV_TRACES"); fi
# every state policy on workloads and traces (about 15 minutes with the two public traces)
.venv/bin/python -m hybridkv.tools.bench_policies "${traces[@]}" --out docs/bench_policies.json \
  --plot docs/img/policies.png > /dev/null
if [ -n "${HYBRIDKV_VLLM_LOAD:-}" ]; then
  .venv-vllm/bin/python -m hybridkv.tools.bench_vllm_load --out docs/bench_vllm_load.json > /dev/null
fi
.venv/bin/python -m hybridkv.tools.bench_report docs/bench.json docs/benchmarks.md
echo "wrote docs/benchmarks.md"
