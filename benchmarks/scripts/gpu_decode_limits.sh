#!/usr/bin/env bash
# One device call: where the decode kernel stands against what is reachable.
#   tests    tests/gpu/test_fp8_gemv.py
#   ceiling  benchmarks/read_ceiling.py: the fastest pure read of each TP1 weight (the GEMV's ceiling)
#   sweep    decode_bench.py --sweep of the wgmma kernel at M in $SWEEP_MS (default 32,64) on $SHAPES
#            (default the TP4 ones), token tiles $BLOCK_MS (default 16,32) besides M's own; --graph
#   cc_sweep decode_bench.py --sweep of the CUDA-core kernel at M in $CC_MS (default 1) over $CC_BLOCKS
#            on $CC_SHAPES (default the TP1 ones)
#   ncu      benchmarks/ncu_decode.py under Nsight Compute at M=$NCU_M (default 32) on $NCU_SHAPES
#            (default tp4_gate_up,tp4_down,tp1_qkv,tp1_down): ours, ours on pre-quantized x, cuBLASLt
#            + its quantization kernel, and the CUDA-core kernel with NCU_CC=block_n,block_k,warps,stages
#            if given; with the sections' details (stall reasons) where ncu has them
#   (benchmarks/scripts/gpu_cuda_core.sh, the CUDA-core kernel's first tests, sweeps and ncu, was folded
#   into this one after commit 9fac6a7: tests, cc_sweep, ncu with NCU_M=1 NCU_CC=...)
#   (sections since removed with the experiments they ran, which did not pay: "tokens_a" of commit
#   71f9a10, benchmarks/exp_tokens_a.py, tokens as the wgmma's register A operand at M 32..64;
#   "streamk" of commit 5a8aba5, benchmarks/exp_stream_k.py, a stream-K CUDA-core kernel)
# run.log has the output, results.tgz the files.
set -u -o pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
SECTIONS=${SECTIONS:-tests ceiling sweep}
SWEEP_MS=${SWEEP_MS:-32,64}
SHAPES=${SHAPES:-tp4_qkv,tp4_o,tp4_gate_up,tp4_down}
BLOCK_MS=${BLOCK_MS:-16,32}
CC_MS=${CC_MS:-1}
CC_SHAPES=${CC_SHAPES:-tp1_qkv,tp1_o,tp1_gate_up,tp1_down}
CC_BLOCKS=${CC_BLOCKS:-16x512x4x1,16x512x8x1,32x512x8x1,8x512x4x1,8x512x8x1,16x1024x8x1,32x512x16x1,16x512x16x1}
R=$OUT/r; mkdir -p "$R"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
{
  echo "# command: SECTIONS='$SECTIONS' SWEEP_MS=$SWEEP_MS SHAPES=$SHAPES BLOCK_MS=$BLOCK_MS CC_MS=$CC_MS CC_SHAPES=$CC_SHAPES CC_BLOCKS=$CC_BLOCKS bash benchmarks/scripts/gpu_decode_limits.sh   ($(date -u +%FT%TZ), commit ${COMMIT:-unknown})"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  if has tests; then
    echo "## tests"; python3 -m pytest -q -m gpu tests/gpu/test_fp8_gemv.py -n 4 ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -8
  fi
  if has ceiling; then
    echo "## ceiling"; timeout 200 python3 benchmarks/read_ceiling.py --out "$R" 2>&1 | tail -30
  fi
  if has sweep; then
    echo "## sweep"
    timeout "${SWEEP_S:-330}" python3 benchmarks/decode_bench.py --sweep --sweep-ms "$SWEEP_MS" --sweep-block-ms "$BLOCK_MS" \
      --ms "16,$SWEEP_MS" --shapes "$SHAPES" --sweep-repeats 10 --graph --out "$R" 2>&1 | grep -v "^  GemvConfig"
    ls "$R"
  fi
  if has cc_sweep; then
    echo "## cc_sweep"; mkdir -p "$R/cc_sweep"
    timeout "${CC_S:-200}" python3 benchmarks/decode_bench.py --sweep --sweep-kinds cuda_core --sweep-ms "$CC_MS" --ms "$CC_MS" \
      --shapes "$CC_SHAPES" --cuda-core-blocks "$CC_BLOCKS" --sweep-repeats 10 --graph \
      --out "$R/cc_sweep" 2>&1 | grep -v "^  GemvConfig" | tail -45
  fi
  if has ncu; then
    echo "## ncu"
    NCU_ARGS=(--clock-control none --profile-from-start off --nvtx --section SpeedOfLight
      --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats
      --section SchedulerStats)
    PROG=(python3 benchmarks/ncu_decode.py --m "${NCU_M:-32}" --shapes "${NCU_SHAPES:-tp4_gate_up,tp4_down,tp1_qkv,tp1_down}"
      ${NCU_CC:+--cuda-core "$NCU_CC"})
    timeout "${NCU_S:-150}" ncu "${NCU_ARGS[@]}" --print-details all "${PROG[@]}" > "$R/ncu.txt" 2>&1
    rc=$?
    if [ $rc -ne 0 ] && grep -q "print-details" "$R/ncu.txt"; then  # an ncu without the option
      timeout "${NCU_S:-150}" ncu "${NCU_ARGS[@]}" "${PROG[@]}" > "$R/ncu.txt" 2>&1
      rc=$?
    fi
    echo "ncu rc=$rc"
    grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Grid Size|Warp Cycles Per Issued|Stall" \
      "$R/ncu.txt" | head -150
  fi
} > "$OUT/run.log" 2>&1
tar -C "$R" -czf "$OUT/results.tgz" .
rm -rf "$R"
tail -60 "$OUT/run.log"
