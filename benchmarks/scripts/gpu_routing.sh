#!/usr/bin/env bash
# One device call. SECTIONS picks some of:
#   tests    tests/gpu (flashinfer wheels carried in .whl/ are installed for them) and the demo
#   decode   fp8route bench decode: the decode kernels against cuBLASLt and CUTLASS, per call and in a graph
#   sweep    bench decode --sweep of the wgmma kernel at M in $SWEEP_MS (default 32,64) on $SHAPES (default
#            the TP4 ones), token tiles $BLOCK_MS (default 16,32) besides M's own: the config table's source
#   cc_sweep bench decode --sweep of the CUDA-core kernel at M in $CC_MS (default 1) over $CC_BLOCKS on
#            $CC_SHAPES (default the TP1 ones)
#   routing  tune (into a copy of the shipped table) + bench gemm, TP1 and TP4
#   bench    bench gemm, TP1 and TP4, against the shipped table (a fresh process's recheck)
#   xq       bench gemm on x quantized upstream (GEMMs alone), TP1 and TP4, against the table
#            tuned by "routing" in the same call, else the shipped one
#   xqtune   routes for x quantized upstream, tuned into a copy of the shipped table and benched, TP1 and TP4
# (default: tests decode routing xq). Sections since removed with the one-off scripts they ran are in git
# history: drift, prefill (git show befbbf5:benchmarks/scripts/gpu_routing_decode.sh), ceiling and ncu
# (git show befbbf5:benchmarks/scripts/gpu_decode_limits.sh), fitactics (6dbe4e3).
# run.log has the output, results.tgz the JSON/PNG files (the device
# returns few files; it is written after every section, so a call cut short keeps what it did) and
# smi.csv the SM clock, power and throttle reasons every 200 ms.
set -u -o pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
SECTIONS=${SECTIONS:-tests decode routing xq}
# flashinfer only for the tests: the shipped table was tuned without it, and its version is
# part of the fingerprint a table must match.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
R=$OUT/r; mkdir -p "$R"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
save() { tar -C "$R" --exclude='*.lock' -czf "$OUT/results.tgz" .; }
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv -lms 200 > "$OUT/smi.csv" 2>&1 &
SMI=$!
{
  echo "# command: SECTIONS='$SECTIONS' bash benchmarks/scripts/gpu_routing.sh   ($(date -u +%FT%TZ), commit ${COMMIT:-unknown})"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  if has tests; then
    echo "## tests"
    PYTHONPATH=$PYTHONPATH:/tmp/site python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
    PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m pytest -q -m gpu tests/gpu -n 4 -rfEs --tb=short > "$R/pytest.log" 2>&1
    grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$R/pytest.log" | tail -40
    echo "## demo"; python3 -m fp8route.cli demo 2>&1 | tail -8
    save
  fi
  if has decode; then
    echo "## decode"; python3 -m fp8route bench decode --graph --out "$R" 2>&1
    save
  fi
  if has sweep; then
    echo "## sweep"
    timeout "${SWEEP_S:-330}" python3 -m fp8route bench decode --sweep --sweep-ms "${SWEEP_MS:-32,64}" \
      --sweep-block-ms "${BLOCK_MS:-16,32}" --ms "16,${SWEEP_MS:-32,64}" --shapes "${SHAPES:-tp4_qkv,tp4_o,tp4_gate_up,tp4_down}" \
      --sweep-repeats 10 --graph --out "$R/sweep" 2>&1 | grep -v "^  DecodeConfig"
    save
  fi
  if has cc_sweep; then
    echo "## cc_sweep"
    timeout "${CC_S:-200}" python3 -m fp8route bench decode --sweep --sweep-kinds cuda_core --sweep-ms "${CC_MS:-1}" \
      --ms "${CC_MS:-1}" --shapes "${CC_SHAPES:-tp1_qkv,tp1_o,tp1_gate_up,tp1_down}" \
      --cuda-core-blocks "${CC_BLOCKS:-16x512x4x1,16x512x8x1,32x512x8x1,8x512x4x1,8x512x8x1,16x1024x8x1}" \
      --sweep-repeats 10 --graph --out "$R/cc_sweep" 2>&1 | grep -v "^  DecodeConfig" | tail -45
    save
  fi
  if has routing; then
    # Into a copy of the shipped table, so its other routes (pre-quantized x, 70B) stay and the
    # result can replace it.
    cp fp8route/routing/defaults/h200.json "$R/routing-h200.json"
    echo "## tune"; python3 -m fp8route.cli tune --model llama-3.1-8b --tp 1,4 --table "$R/routing-h200.json" | grep -v "^tune \["
    for tp in 1 4; do
      echo "## bench tp$tp"; python3 -m fp8route.cli bench gemm --model llama-3.1-8b --tp $tp --table "$R/routing-h200.json" --out "$R" | grep -v "^bench \["
    done
    save
  fi
  if has bench; then
    for tp in 1 4; do
      echo "## bench tp$tp against the shipped table"
      python3 -m fp8route.cli bench gemm --model llama-3.1-8b --tp $tp --table fp8route/routing/defaults/h200.json \
        --out "$R" | grep -v "^bench \["
    done
    save
  fi
  if has xq; then
    TABLE=fp8route/routing/defaults/h200.json
    has routing && TABLE=$R/routing-h200.json  # the table this call just tuned
    for tp in 1 4; do
      echo "## bench tp$tp, x quantized upstream"
      python3 -m fp8route.cli bench gemm --model llama-3.1-8b --tp $tp --x-quantized \
        --table "$TABLE" --out "$R" | grep -v "^bench \["
    done
    save
  fi
  if has xqtune; then
    # Routes for pre-quantized x, tuned into a copy of the shipped table, then benched on that path.
    [ -f "$R/routing-h200.json" ] || cp fp8route/routing/defaults/h200.json "$R/routing-h200.json"
    python3 -m pytest -q -m gpu tests/gpu/test_routing_gpu.py 2>&1 | tail -2
    echo "## tune tp1 and tp4, x quantized upstream"
    python3 -m fp8route.cli tune --model llama-3.1-8b --tp 1,4 --x-quantized --table "$R/routing-h200.json" \
      | grep -v "^tune \["
    for tp in 1 4; do
      echo "## bench tp$tp, x quantized upstream"
      python3 -m fp8route.cli bench gemm --model llama-3.1-8b --tp $tp --x-quantized --table "$R/routing-h200.json" \
        --out "$R" | grep -v "^bench \["
    done
    save
  fi
} > "$OUT/run.log" 2>&1
kill $SMI
save
rm -rf "$R"
grep -E "passed|failed|TP1 sum|layer sum: floor|tuned in|FAIL|PASS" "$OUT/run.log" | tail -20
