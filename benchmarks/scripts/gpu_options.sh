#!/usr/bin/env bash
# The kernel options (issue 28) and the CPU-verified commits before them, on one H200, output under
# $OUT. PHASES lists what to run, in order:
#   tests: the GPU tests of the kernel options, the greedy-token kernels, the engine, prefill graphs,
#          mixed steps (TESTS overrides which)
#   e2e:   bench e2e, routed, every combination of --pdl and --silu-in-down in one run
#   block: what keeps the host waiting in a 4 x 2048 prefill (benchmarks/prefill_host.py --find-block),
#          on a random 8B checkpoint written to /tmp/ckpt-8b first
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log="$OUT/gpu.txt"
echo "# PHASES='$PHASES' COMMIT=${COMMIT:-unknown} bash benchmarks/scripts/gpu_options.sh ($(date -u +%FT%TZ))" | tee "$log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log"
for phase in $PHASES; do
    case $phase in
    tests)
        tests=${TESTS:-"tests/gpu/test_kernel_options_gpu.py tests/gpu/test_silu_in_down_gpu.py tests/gpu/test_argmax_gpu.py \
tests/gpu/test_engine_gpu.py tests/engine/test_prefill_graphs.py tests/engine/test_mixed_step.py tests/gpu/test_fp8_gemv.py"}
        # shellcheck disable=SC2086
        timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest -q $tests -n 4 -rfEs --tb=short > "$OUT/gpu_tests.log" 2>&1
        tail -3 "$OUT/gpu_tests.log" | tee -a "$log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20 | tee -a "$log"
        ;;
    e2e)
        timeout "${E2E_TIMEOUT:-500}" python3 -m fp8route bench e2e --random llama-3.1-8b --batch "${BATCH:-1,16}" \
            --input "${INPUT:-1024}" --output 64 --policy routed --pdl off,on --silu-in-down off,on --tmp /tmp \
            --out "$OUT" > "$OUT/e2e.log" 2>&1
        echo "== e2e (rc $?)" | tee -a "$log"; tail -16 "$OUT/e2e.log" | tee -a "$log"
        ;;
    block)
        [ -f /tmp/ckpt-8b/config.json ] || python3 -c "
from pathlib import Path
from fp8route.checkpoint.random import write_random
from fp8route.models.shapes import MODELS
write_random(Path('/tmp/ckpt-8b'), MODELS['llama-3.1-8b'], fp8=True)" 2>&1 | tail -1
        timeout 300 python3 benchmarks/prefill_host.py /tmp/ckpt-8b --cases 2048x4 4096 2048x2 --graphs off \
            --find-block 2048x4 > "$OUT/find_block.txt" 2>&1
        echo "== block (rc $?)" | tee -a "$log"; grep -v Warning "$OUT/find_block.txt" | tail -20 | tee -a "$log"
        ;;
    esac
done
