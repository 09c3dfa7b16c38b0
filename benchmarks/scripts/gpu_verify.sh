#!/usr/bin/env bash
# One device call after kernel changes: tests/gpu with FlashInfer installed (carried wheels in .whl/),
# then bench e2e at batch 1 and 16, builtin vs FlashInfer attention. Output under $OUT.
set -u -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
echo "# bash benchmarks/scripts/gpu_verify.sh   ($(date -u +%FT%TZ), commit ${COMMIT:-unknown})" | tee "$OUT/gpu.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/gpu.txt"
timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest -q -m gpu tests/gpu -n 4 -rfEs --tb=short > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
timeout 250 python3 -m fp8route bench e2e --random llama-3.1-8b --batch 1,16 --input 1024 --output 64 \
  --policy routed --attention builtin,flashinfer --tmp /tmp --out "$OUT" > "$OUT/e2e.log" 2>&1
tail -7 "$OUT/e2e.log"
