#!/usr/bin/env bash
# One device call: fp8route bench e2e on a random Llama-3.1-8B checkpoint (ModelOpt FP8 and bf16).
# EXTRA adds options (e.g. --pdl off,on).
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  echo "# bash benchmarks/scripts/gpu_e2e.sh   ($(date -u +%FT%TZ), commit ${COMMIT:-unknown})"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -m fp8route bench e2e --random llama-3.1-8b --batch ${BATCH:-1,8,16} --input ${INPUT:-1024,4096} \
    --output ${OUTPUT:-64} --policy ${ARMS:-routed,cublas,rowwise,bf16} --tmp /tmp --out "$OUT" ${EXTRA:-}
} 2>&1 | tee "$OUT/run.log"
