#!/usr/bin/env bash
# The core's GPU checks on the device machine: fingerprint, tests/gpu for the backends, demo.
# Run from the repo root with the flashinfer wheels carried in .whl/ (README: GPU checks).
set -u -o pipefail
OUT=${OUT:-benchmarks/results/h200}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
{
  echo "# command: bash benchmarks/scripts/gpu_core.sh   ($(date -u +%FT%TZ))"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; p=torch.cuda.get_device_properties(0); print(f'{p.name} sm{p.major}{p.minor} SMs={p.multi_processor_count} L2={p.L2_cache_size>>20}MiB torch={torch.__version__} cuda={torch.version.cuda} triton={triton.__version__}')"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
} | tee "$OUT/fingerprint.txt"
python3 -m pytest -q -m gpu tests/gpu -n 4 -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
python3 -m fp8route.cli demo 2>&1 | tee "$OUT/demo_gpu.log" | tail -8
