#!/usr/bin/env bash
# One device call: host cost per eager call (benchmarks/host_cost.py), then the e2e bench with the
# arms in the order ARMS gives (the 1x1024 prefill is host-bound, so order and launch cost show there).
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  echo "# bash benchmarks/scripts/gpu_host_cost.sh   ($(date -u +%FT%TZ), commit ${COMMIT:-unknown})"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 benchmarks/host_cost.py --profile
} 2>&1 | tee "$OUT/host_cost.log"
[ "${E2E:-1}" = 1 ] && bash benchmarks/scripts/gpu_e2e.sh
