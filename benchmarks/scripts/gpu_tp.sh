#!/usr/bin/env bash
# One call on nvidia-h200-x2: the all-reduce microbenchmark, then fp8route bench e2e with TP1 and TP2
# side by side on a random Llama-3.1-8B checkpoint (ModelOpt FP8). NVLink multicast stays off.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
  echo "# bash benchmarks/scripts/gpu_tp.sh   ($(date -u +%FT%TZ), commit ${COMMIT:-unknown})"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m || true
  timeout 120 python3 benchmarks/allreduce_bench.py --ranks 2 --out "$OUT"
  [ "${SKIP_E2E:-0}" = 1 ] && exit 0
  timeout ${E2E_TIMEOUT:-440} python3 -m fp8route bench e2e --random llama-3.1-8b --tp 1,2 --all-reduce ${METHODS:-nccl,symm_mem} \
    --batch ${BATCH:-1,16} --input ${INPUT:-4096} --output ${OUTPUT:-64} --policy ${ARMS:-routed} --tmp /tmp --out "$OUT"
} 2>&1 | tee "$OUT/run.log"
