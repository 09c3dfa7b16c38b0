#!/usr/bin/env bash
# The serving engine on one H200 (issues 26 and 27), in one device call, output under $OUT. PHASES
# lists what to run, in order:
#   tests:    the GPU tests of the paged engine (TESTS overrides which)
#   generate: the static generate at 256 x 1024 and 16 x 8192
#   prefill:  the seed's prefill-heavy load, routed vs cuBLASLt-only vs CUTLASS-rowwise-only, with a
#             lone 1 x 4096 prefill timed in each arm
#   decode:   the decode-heavy load, with the static generate at batch 16 timed in the arm
#   poisson:  a Poisson load at RATE requests/s, once per step budget in POISSON_BUDGET ("512 2048")
#   prefix:   256 requests sharing a 2048-token prefix, the prefix cache on and off
# A random Llama-3.1-8B FP8 checkpoint is written first; EXTRA adds options to every bench serve.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log="$OUT/gpu.txt"
echo "# PHASES='$PHASES' COMMIT=${COMMIT:-unknown} bash benchmarks/scripts/gpu_serve.sh ($(date -u +%FT%TZ))" | tee "$log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log"
ckpt=/tmp/ckpt-8b
[ -f $ckpt/config.json ] || python3 -c "
from pathlib import Path
from fp8route.checkpoint.random import write_random
from fp8route.models.shapes import MODELS
write_random(Path('$ckpt'), MODELS['llama-3.1-8b'], fp8=True)" 2>&1 | tail -1
serve() {  # name, then bench serve's options
    local name=$1; shift
    # shellcheck disable=SC2086
    timeout "${SERVE_TIMEOUT:-300}" python3 -m fp8route bench serve "$ckpt" --max-model-len 8192 --out "$OUT/$name" \
        "$@" ${EXTRA:-} > "$OUT/$name.log" 2>&1
    echo "== $name (rc $?): bench serve $*" | tee -a "$log"
    grep -A20 "^arm " "$OUT/$name.log" | tee -a "$log"
}
for phase in $PHASES; do
    case $phase in
    tests)
        tests=${TESTS:-"tests/gpu/test_decode_attention.py tests/gpu/test_large_prefill.py tests/gpu/test_engine_gpu.py \
tests/gpu/test_fused_gpu.py"}
        # shellcheck disable=SC2086
        timeout 240 python3 -m pytest -q $tests -n 4 -rfEs --tb=short > "$OUT/gpu_tests.log" 2>&1
        tail -3 "$OUT/gpu_tests.log" | tee -a "$log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20 | tee -a "$log"
        ;;
    generate) timeout 120 python3 benchmarks/generate_large.py "$ckpt" 2>&1 | grep -v Warning | tee -a "$log" ;;
    prefill)
        serve prefill --policy "${PREFILL_POLICY:-routed,cublas,rowwise}" --num-prompts 512 --input-len 1024:4096 --output-len 16:64 \
            --lone-prefill 4096 ;;
    decode)
        serve decode --policy routed --num-prompts 1024 --input-len 512:1536 --output-len 128:512 --static-batch 16 ;;
    poisson)  # POISSON_BUDGET may list several step budgets: one run each, in this call
        for budget in ${POISSON_BUDGET:-2048}; do
            serve "poisson_$budget" --policy routed --num-prompts "${POISSON_PROMPTS:-400}" --input-len 512:1536 \
                --output-len 128:512 --request-rate "${RATE:-8}" --max-num-batched-tokens "$budget"
        done ;;
    prefix)
        serve prefix --policy routed --prefix-caching on,off --num-prompts 256 --shared-prefix 2048 \
            --input-len 64:64 --output-len 16:16 ;;
    esac
done
