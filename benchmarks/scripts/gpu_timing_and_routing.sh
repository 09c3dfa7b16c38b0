#!/usr/bin/env bash
# One device call: the timing tests, the noise experiment, tune + bench gemm (TP1, TP4) with the
# batch-queued timing, and the decode bench with CUDA-graph timing. Everything lands in $OUT;
# run.log carries the output, results.tgz the JSON/PNG files (the device returns few files).
set -u -o pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p "$R"
{
  echo "# command: bash benchmarks/scripts/gpu_timing_and_routing.sh   ($(date -u +%FT%TZ))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  python3 -m pytest -q -m gpu tests/gpu/test_timing_gpu.py tests/gpu/test_routing_gpu.py 2>&1 | tail -4
  echo "## timing noise"; python3 benchmarks/timing_noise.py --out "$R"
  echo "## tune"; python3 -m fp8route.cli tune --model llama-3.1-8b --tp 1,4 --table "$R/routing-h200.json"
  for tp in 1 4; do
    echo "## bench tp$tp"; python3 -m fp8route.cli bench gemm --model llama-3.1-8b --tp $tp --table "$R/routing-h200.json" --out "$R" | tail -60
  done
  echo "## decode"; python3 benchmarks/decode_bench.py --graph --out "$R" 2>&1 | tail -75
} > "$OUT/run.log" 2>&1
rm -f "$R"/*.lock
tar -C "$R" -czf "$OUT/results.tgz" .
rm -rf "$R"
tail -5 "$OUT/run.log"
