#!/usr/bin/env bash
# One call on nvidia-h200-x2: tune Llama-3.1-8B's TP2 shapes into a copy of the shipped H200 table,
# then bench e2e TP1 vs TP2 with that table, then profile a decode step per kernel kind.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FP8ROUTE_TABLE=$OUT/routing-h200.json
cp fp8route/routing/defaults/h200.json "$FP8ROUTE_TABLE"
{
  echo "# bash benchmarks/scripts/gpu_tp_tune.sh   ($(date -u +%FT%TZ), commit ${COMMIT:-unknown})"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  [ "${GPU_TESTS:-0}" = 1 ] && python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_gpu.py 2>&1 | tail -3
  if [ "${TUNE:-1}" = 1 ]; then
    python3 -m fp8route tune --model llama-3.1-8b --tp 2 | tail -25
    python3 -m fp8route tune --model llama-3.1-8b --tp 2 --x-quantized | tail -5
  fi
  timeout ${E2E_TIMEOUT:-300} python3 -m fp8route bench e2e --random llama-3.1-8b --tp 1,2 --all-reduce ${METHODS:-nccl} \
    --batch ${BATCH:-1,16} --input ${INPUT:-4096} --output ${OUTPUT:-64} --policy routed --tmp /tmp --out "$OUT"
  timeout 150 python3 benchmarks/tp_decode_profile.py --tp 1,2 --batch 1 --out "$OUT"
} 2>&1 | tee "$OUT/run.log"
