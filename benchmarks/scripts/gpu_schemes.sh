#!/usr/bin/env bash
# The FP8 schemes (issue 45) on one H200, in one device call, output under $OUT. PHASES lists what to
# run, in order:
#   probe:  the versions, and whether a carried DeepGEMM wheel (.whl/, optional) imports and runs
#   tests:  the GPU tests of the schemes' kernels and backends (TESTS overrides which)
#   tune:   fp8route tune for Llama-3.1-8B TP1 in each of SCHEMES (default channel block; TUNE_ARGS adds
#           options, e.g. "--m 1,2,4,8,16" for the decode buckets alone), into a copy
#           of the shipped table ($OUT/routing-h200.json)
#   sweep:  the block decode GEMM's configs at SWEEP_MS (default 1) on the 8B shapes; the winners written
#           into this tree's configs._H200_BLOCK (block_table_entries.py --write), so later phases use them
#   bench:  fp8route bench gemm per scheme at the M values, routed by that table
#   e2e:    bench e2e on random Llama-3.1-8B checkpoints of tensor, channel and block (routed by that
#           table): batch-1 decode and TTFT at 1x4096, each scheme against per-tensor in the same run
#           (E2E_POLICY, E2E_BATCH and E2E_ARGS widen it, e.g. E2E_ARGS="--quantize-upstream off,on")
#   flashinfer: FlashInfer's SM90 block GEMM (fp8_blockscale_gemm_sm90, JIT-built there by nvcc) from a
#           carried wheel (.carry/fi/*.whl: flashinfer-python and apache-tvm-ffi) against cuBLASLt's
#           recipe and the Triton block GEMM, bench gemm at FI_MS (default 1,16,512,2048,8192)
#   serve:  bench serve's prefill-heavy (PREFILL_PROMPTS of 1024-4096, 32 out) and decode-heavy
#           (DECODE_PROMPTS of 512-1536, 128-512 out) loads, one arm per scheme
set -u -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log="$OUT/gpu.txt"
schemes=${SCHEMES:-"channel block"}
ms=${MS:-1,2,4,8,16,32,64,128,512,2048,8192}
table=${TABLE:-"$OUT/routing-h200.json"}
echo "# PHASES='$PHASES' SCHEMES='$schemes' COMMIT=${COMMIT:-unknown} bash benchmarks/scripts/gpu_schemes.sh ($(date -u +%FT%TZ))" | tee "$log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$log"
[ -f "$table" ] || cp fp8route/routing/defaults/h200.json "$table"
for phase in $PHASES; do
    echo "-- $phase $(date -u +%T)" | tee -a "$log"
    case $phase in
    probe)
        if ls .whl/*deep_gemm*.whl >/dev/null 2>&1; then
            python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dg .whl/*deep_gemm*.whl 2>&1 | tail -2
            PYTHONPATH=/tmp/dg:$PYTHONPATH timeout 120 python3 -c "
import torch, deep_gemm
print('deep_gemm imports:', getattr(deep_gemm, '__version__', '?'), [n for n in dir(deep_gemm) if 'fp8' in n][:8])
" 2>&1 | tail -3 | tee -a "$log"
        fi ;;
    tests)
        tests=${TESTS:-"tests/gpu/test_schemes_gpu.py tests/kernels/test_quantize_dynamic.py tests/kernels/test_decode_gemm_schemes.py \
tests/kernels/test_block_gemm.py tests/test_schemes.py"}
        # shellcheck disable=SC2086
        timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q $tests -n "${WORKERS:-4}" -rfEs --tb=short -p no:cacheprovider \
            > "$OUT/gpu_tests.log" 2>&1
        tail -3 "$OUT/gpu_tests.log" | tee -a "$log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -30 | tee -a "$log" ;;
    tune)
        for s in $schemes; do
            # shellcheck disable=SC2086
            timeout "${TUNE_TIMEOUT:-240}" python3 -m fp8route tune --model llama-3.1-8b --scheme "$s" --table "$table" ${TUNE_ARGS:-} \
                > "$OUT/tune-$s.log" 2>&1
            echo "== tune $s (rc $?)" | tee -a "$log"; grep -v "^\s*$" "$OUT/tune-$s.log" | grep -v "\r" | tail -14 | tee -a "$log"
        done ;;
    sweep)
        timeout "${SWEEP_TIMEOUT:-240}" python3 benchmarks/scripts/block_decode_sweep.py --out "$OUT" --ms "${SWEEP_MS:-1}" \
            > "$OUT/sweep.log" 2>&1
        echo "== block decode sweep (rc $?)" | tee -a "$log"; grep -A12 "^shape " "$OUT/sweep.log" | tee -a "$log"
        python3 benchmarks/scripts/block_table_entries.py "$OUT/block_decode_sweep.json" --write 2>&1 | tee -a "$log" ;;
    bench)
        for s in $schemes; do
            timeout "${BENCH_TIMEOUT:-240}" python3 -m fp8route bench gemm --model llama-3.1-8b --scheme "$s" --m "$ms" \
                --table "$table" --out "$OUT" > "$OUT/bench-$s.log" 2>&1
            echo "== bench gemm $s (rc $?)" | tee -a "$log"; grep -E "layer sum|PASS|FAIL|slower" "$OUT/bench-$s.log" | head -20 | tee -a "$log"
        done ;;
    e2e)
        FP8ROUTE_TABLE="$table" timeout "${E2E_TIMEOUT:-300}" python3 -m fp8route bench e2e --random llama-3.1-8b \
            --scheme ${E2E_SCHEMES:-tensor,channel,block} --policy "${E2E_POLICY:-routed}" --batch "${E2E_BATCH:-1}" \
            --input 4096 --output 64 --tmp /tmp --out "$OUT" ${E2E_ARGS:-} > "$OUT/e2e.log" 2>&1
        echo "== e2e (rc $?)" | tee -a "$log"; tail -${E2E_TAIL:-12} "$OUT/e2e.log" | tee -a "$log" ;;
    flashinfer)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/fi/*.whl \
            2>&1 | tail -2 | tee -a "$log"
        PYTHONPATH=$PYTHONPATH:/tmp/site timeout "${FI_TIMEOUT:-300}" python3 -m fp8route bench gemm --model llama-3.1-8b \
            --scheme block --m "${FI_MS:-1,16,512,2048,8192}" --policy cublas_block,triton_block,flashinfer_block \
            --out "$OUT" > "$OUT/flashinfer.log" 2>&1
        echo "== flashinfer block GEMM (rc $?)" | tee -a "$log"; grep -vE "^\s*$" "$OUT/flashinfer.log" | tail -30 | tee -a "$log" ;;
    serve)
        for load in prefill decode; do
            if [ $load = prefill ]; then
                args="--num-prompts ${PREFILL_PROMPTS:-128} --input-len 1024:4096 --output-len 32:32"
            else
                args="--num-prompts ${DECODE_PROMPTS:-256} --input-len 512:1536 --output-len 128:512"
            fi
            # shellcheck disable=SC2086
            FP8ROUTE_TABLE="$table" timeout "${SERVE_TIMEOUT:-240}" python3 -m fp8route bench serve --random llama-3.1-8b \
                --scheme tensor,channel,block --policy routed --max-model-len 8192 --tmp /tmp --out "$OUT" $args \
                > "$OUT/serve-$load.log" 2>&1
            echo "== serve $load (rc $?): $args" | tee -a "$log"; grep -A8 "^arm " "$OUT/serve-$load.log" | tail -9 | tee -a "$log"
        done ;;
    esac
done
