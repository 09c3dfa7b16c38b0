#!/usr/bin/env bash
# One device call: the CUDA-core decode kernel (fp8_gemv, M <= 8) checked, swept and profiled.
#   tests  tests/gpu/test_fp8_gemv.py (CUDA-core cases and the input checks)
#   sweep  decode_bench.py --sweep over the CUDA-core configs at M in $SWEEP_MS (default 1,2; ours_best = its best)
#   ncu    benchmarks/ncu_decode.py under Nsight Compute, M=1, TP1 shapes
#   (two sections of commit bf985be, since removed with the options they timed: "prefetch", the M=1
#   sweep over L2 prefetch distances 0, 2, 4, 8, and "pdl", decode_bench --pdl --graph --ms 1,2)
# run.log has the output, results.tgz the files (the device returns few files).
set -u -o pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
SECTIONS=${SECTIONS:-tests sweep ncu}
SWEEP_S=${SWEEP_S:-400}
NCU_CC=${NCU_CC:-16,512,1,3}
R=$OUT/r; mkdir -p "$R"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
{
  echo "# command: SECTIONS='$SECTIONS' SWEEP_S=$SWEEP_S NCU_CC=$NCU_CC bash benchmarks/scripts/gpu_cuda_core.sh   ($(date -u +%FT%TZ), commit ${COMMIT:-unknown})"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  if has tests; then
    echo "## tests"; python3 -m pytest -q -m gpu tests/gpu/test_fp8_gemv.py -n 4 ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -8
  fi
  if has sweep; then
    echo "## sweep"
    timeout "$SWEEP_S" python3 benchmarks/decode_bench.py --sweep --sweep-kinds cuda_core --sweep-ms ${SWEEP_MS:-1,2} \
      --ms ${SWEEP_MS:-1,2} --sweep-repeats 10 --out "$R" 2>&1
  fi
  if has ncu; then
    echo "## ncu"
    timeout 120 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
      python3 benchmarks/ncu_decode.py --m 1 --cuda-core "$NCU_CC" > "$R/ncu_m1.txt" 2>&1
    echo "ncu rc=$?"
    grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Compute \(SM\) Throughput" "$R/ncu_m1.txt" | head -80
  fi
} > "$OUT/run.log" 2>&1
tar -C "$R" -czf "$OUT/results.tgz" .
rm -rf "$R"
tail -40 "$OUT/run.log"
