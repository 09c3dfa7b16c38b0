#!/usr/bin/env bash
# Issue 49's GPU half in one device call, output under $OUT: the deterministic mode's tests on the GPU
# (TESTS_EXTRA: more test files), then on random Llama-3.1-8B FP8 checkpoints (one per SCHEMES) the
# equality check (8 probes alone and inside batches of 16, 64, 256: how many differ, mode on and off),
# and the mode's cost on bench e2e (routed vs deterministic arms, batch 1 and 16, inputs E2E_INPUTS,
# default 1024,4096; E2E_OUTPUT tokens out, default 64: raise it where the step split says the context left
# too few tokens, as at 16x4096). PHASES picks: tune tests equal e2e sweep serve; tune re-times SCHEMES'
# routes (x quantized by each layer, then handed over quantized) into a copy of the shipped table
# ($OUT/routing-h200.json; the later phases route by it), so that tilings the shipped table never timed
# (the fixed-tile ones) can be chosen; sweep times the fixed-tile GEMM's
# tilings per layer (fixed_gemm_sweep.py; SWEEP_SCHEMES, e.g. "tensor,float" for the lm_head too,
# SWEEP_MS); serve runs bench serve's decode-heavy and prefill-heavy loads with and without --deterministic.
set -u -o pipefail
log="$OUT/gpu.txt"
: "${PHASES:=tests equal e2e}" "${SCHEMES:=tensor}"  # here, not inside the pipeline below (a subshell)
echo "# PHASES='$PHASES' SCHEMES='$SCHEMES' bash benchmarks/scripts/gpu_deterministic.sh ($(date -u +%FT%TZ))" | tee "$log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
checkpoint() {  # scheme -> folder
    local folder=/tmp/ckpt-8b-$1
    [ -f "$folder/config.json" ] || python3 -c "
from pathlib import Path
from fp8route.checkpoint.random import write_random
from fp8route.models.shapes import MODELS
write_random(Path('$folder'), MODELS['llama-3.1-8b'], fp8=True, scheme='$1')" > /dev/null 2>&1
    echo "$folder"
}
for phase in $PHASES; do
    case $phase in
    tune)
        cp fp8route/routing/defaults/h200.json "$OUT/routing-h200.json"
        export FP8ROUTE_TABLE="$OUT/routing-h200.json"
        for scheme in $SCHEMES; do
            for input in "" --x-quantized; do  # x quantized by each layer, then handed over quantized
                name=$scheme${input:+-xq}
                timeout "${TUNE_TIMEOUT:-240}" python3 -m fp8route tune --model llama-3.1-8b --scheme "$scheme" $input \
                    --table "$FP8ROUTE_TABLE" > "$OUT/tune-$name.log" 2>&1
                echo "== tune $name (rc $?)" | tee -a "$log"
                grep -v "\r" "$OUT/tune-$name.log" | grep -E "M [0-9]" | tail -8 | tee -a "$log"
            done
        done ;;
    tests)
        timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
            tests/kernels/test_fixed_gemm.py tests/engine/test_deterministic_kernels.py \
            tests/engine/test_deterministic.py tests/engine/test_scheduler.py ${TESTS_EXTRA:-} > "$OUT/tests.log" 2>&1
        echo "== tests (rc $?)" | tee -a "$log"
        tail -1 "$OUT/tests.log" | tee -a "$log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | tee -a "$log" ;;
    equal)
        for scheme in $SCHEMES; do
            echo "== equality $scheme" | tee -a "$log"
            timeout "${ARM_TIMEOUT:-240}" python3 benchmarks/scripts/deterministic_equality.py "$(checkpoint "$scheme")" \
                --out "$OUT" > "$OUT/equal-$scheme.log" 2>&1
            tail -3 "$OUT/equal-$scheme.log" | tee -a "$log"
        done ;;
    e2e)
        for scheme in $SCHEMES; do
            timeout "${ARM_TIMEOUT:-240}" python3 -m fp8route bench e2e "$(checkpoint "$scheme")" --batch 1,16 \
                --input "${E2E_INPUTS:-1024,4096}" --output "${E2E_OUTPUT:-64}" --policy routed,deterministic \
                --out "$OUT" > "$OUT/e2e-$scheme.log" 2>&1
            echo "== e2e $scheme (rc $?)" | tee -a "$log"
            sed -n '/^arm /,$p' "$OUT/e2e-$scheme.log" | tee -a "$log"  # the table, the step by kernel
        done ;;
    sweep)
        timeout "${ARM_TIMEOUT:-240}" python3 benchmarks/scripts/fixed_gemm_sweep.py --out "$OUT" \
            --schemes "${SWEEP_SCHEMES:-${SCHEMES// /,}}" --ms "${SWEEP_MS:-1,16,256,4096}" > "$OUT/sweep.log" 2>&1
        echo "== sweep (rc $?)" | tee -a "$log"
        grep -A 20 "^scheme" "$OUT/sweep.log" | tee -a "$log" ;;
    serve)
        ckpt=$(checkpoint tensor)
        for mode in "" --deterministic; do
            for load in "decode --num-prompts ${DECODE_PROMPTS:-512} --input-len 512:1536 --output-len 128:512" \
                        "prefill --num-prompts ${PREFILL_PROMPTS:-128} --input-len 1024:4096 --output-len 32:32"; do
                set -- $load
                name=$1; shift
                timeout "${ARM_TIMEOUT:-240}" python3 -m fp8route bench serve "$ckpt" --max-model-len 8192 $mode "$@" \
                    --out "$OUT/serve-$name${mode:+-det}" > "$OUT/serve-$name${mode:+-det}.log" 2>&1
                echo "== serve $name ${mode:-default} (rc $?)" | tee -a "$log"
                tail -2 "$OUT/serve-$name${mode:+-det}.log" | tee -a "$log"
            done
        done ;;
    esac
done
