#!/usr/bin/env bash
# The one-forward engine (issue 36) on one H200, in one device call, output under $OUT. PHASES lists
# what to run, in order:
#   kernel:  the paged attention kernel against the decode kernel, SDPA and cuDNN (fp8route bench attention),
#            and FlashInfer's FA2/FA3 prefill where .carry/fi holds its wheels (apache-tvm-ffi's built for the
#            machine's Python, 3.12: `pip download --no-deps --only-binary=:all: --python-version 3.12`; the
#            flashinfer-python wheel stripped of other architectures' sources to fit the carry's 64 MiB, as
#            results/h200/flashinfer_attention/COMMAND.md says); SWEEP=1: its tilings too
#   tests:   the GPU tests of the kernel, the engine, the graphs (TESTS overrides which, WORKERS the
#            pytest processes, 4); the serving
#            phases after it are skipped when one fails
#   decode:  bench serve's decode-heavy load (1024 prompts of 512-1536, 128-512 out), against its own
#            bound (a lone 4096-token prefill timed in the arm)
#   prefill: the seed's prefill-heavy load (256 prompts of 1024-4096, 32 out), routed vs cuBLASLt-only
#            vs CUTLASS-rowwise-only, each against a lone 4096-token prefill
#   poisson: Poisson arrivals at RATE requests/s (512-1536 in, 128-512 out, budget 2048)
#   prefix:  256 requests behind a 2048-token shared prefix, the prefix cache on and off
#   e2e:     bench e2e, routed, BATCH (1,16) x INPUT (1024,4096): TTFT and decode against what held before
#   profile: host time per step and the GPU's idle time between decode steps (fp8route bench idle)
#   sampling: the decode-heavy load (512 prompts) greedy, with mixed sampling controls (top_k, top_p, min_p,
#            penalties, logprobs=5) and with a JSON schema; the schema compiles against a real tokenizer
#            (.carry/tokenizer.json, SmolLM2's, copied into the random checkpoint: its ids past 49152 are
#            never allowed)
# A random Llama-3.1-8B FP8 checkpoint is written first where a phase needs it.
set -u -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log="$OUT/gpu.txt"
echo "# PHASES='$PHASES' COMMIT=${COMMIT:-unknown} bash benchmarks/scripts/gpu_engine.sh ($(date -u +%FT%TZ))" | tee "$log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log"
ckpt=/tmp/ckpt-8b
checkpoint() {
    [ -f $ckpt/config.json ] || python3 -c "
from pathlib import Path
from fp8route.checkpoint.random import write_random
from fp8route.models.shapes import MODELS
write_random(Path('$ckpt'), MODELS['llama-3.1-8b'], fp8=True)" 2>&1 | tail -1
}
serve() {  # name, then bench serve's options
    local name=$1; shift
    checkpoint
    # shellcheck disable=SC2086
    timeout "${SERVE_TIMEOUT:-300}" python3 -m fp8route bench serve "$ckpt" --max-model-len 8192 --out "$OUT" \
        "$@" ${EXTRA:-} > "$OUT/$name.log" 2>&1
    echo "== $name (rc $?): bench serve $*" | tee -a "$log"
    grep -A30 "^arm " "$OUT/$name.log" | grep -v "^wrote" | tee -a "$log"
}
failed=0
for phase in $PHASES; do
    if [ $failed = 1 ] && [ "$phase" != kernel ]; then
        echo "== $phase skipped: the tests failed" | tee -a "$log"; continue
    fi
    case $phase in
    kernel)
        site=""
        if compgen -G ".carry/fi/*.whl" > /dev/null; then  # FlashInfer's FA2 and FA3 prefill arms (JIT: minutes)
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
                .carry/fi/*.whl && site=/tmp/site
        fi
        PYTHONPATH=$PYTHONPATH${site:+:$site} timeout "${KERNEL_TIMEOUT:-300}" python3 -m fp8route bench attention \
            2>&1 | grep -v Warn | tee -a "$log"
        [ "${SWEEP:-0}" = 1 ] && timeout 150 python3 -m fp8route bench attention --sweep 2>&1 | grep -v Warn | tee -a "$log"
        ;;
    tests)
        tests=${TESTS:-"tests/gpu/test_paged_attention_gpu.py tests/engine/test_mixed_step.py tests/engine/test_prefill_graphs.py \
tests/gpu/test_engine_gpu.py tests/gpu/test_decode_attention.py tests/gpu/test_fp8_kv_gpu.py"}
        # shellcheck disable=SC2086
        timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q $tests -n "${WORKERS:-4}" -rfEs --tb=short -p no:cacheprovider \
            > "$OUT/gpu_tests.log" 2>&1 || failed=1
        tail -3 "$OUT/gpu_tests.log" | tee -a "$log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20 | tee -a "$log"
        [ "${KEEP_GOING:-0}" = 1 ] && failed=0 ;;
    decode)
        serve decode --policy routed --num-prompts 1024 --input-len 512:1536 --output-len 128:512 --lone-prefill 4096 ;;
    prefill)
        serve prefill --policy "${PREFILL_POLICY:-routed,cublas,rowwise}" --num-prompts 256 --input-len 1024:4096 \
            --output-len 32:32 --lone-prefill 4096 ;;
    poisson)
        serve poisson --policy routed --num-prompts "${POISSON_PROMPTS:-400}" --input-len 512:1536 \
            --output-len 128:512 --request-rate "${RATE:-15}" --max-num-batched-tokens 2048 ;;
    prefix)
        serve prefix --policy routed --prefix-caching on,off --num-prompts 256 --shared-prefix 2048 \
            --input-len 64:64 --output-len 16:16 ;;
    e2e)
        checkpoint
        timeout "${E2E_TIMEOUT:-300}" python3 -m fp8route bench e2e "$ckpt" --batch "${BATCH:-1,16}" \
            --input "${INPUT:-1024,4096}" --output 64 --policy routed --out "$OUT" > "$OUT/e2e.log" 2>&1
        echo "== e2e (rc $?)" | tee -a "$log"; tail -8 "$OUT/e2e.log" | tee -a "$log" ;;
    sampling)
        checkpoint
        cp .carry/tokenizer.json $ckpt/
        serve sampling --policy routed --sampling greedy,mixed,json --num-prompts "${SAMPLING_PROMPTS:-512}" \
            --input-len 512:1536 --output-len 128:512 ;;
    profile)
        checkpoint
        timeout 200 python3 -m fp8route bench idle "$ckpt" > "$OUT/profile.log" 2>&1
        echo "== profile (rc $?)" | tee -a "$log"; tail -12 "$OUT/profile.log" | tee -a "$log" ;;
    esac
done
