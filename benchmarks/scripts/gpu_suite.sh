#!/usr/bin/env bash
# One device call: the GPU tests, the demo and generate on the real model, with the device named.
# Run from the repo root: bash benchmarks/scripts/gpu_suite.sh   (output under $OUT)
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  echo "# bash benchmarks/scripts/gpu_suite.sh   ($(date -u +%FT%TZ), commit ${COMMIT:-unknown})"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "## tests/gpu"
  timeout 420 python3 -m pytest -q -m gpu tests/gpu -n 4 -rfEs --tb=short > "$OUT/pytest.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -30
  echo "## demo"; python3 -m fp8route demo 2>&1 | tail -4
} 2>&1 | tee "$OUT/run.log"
