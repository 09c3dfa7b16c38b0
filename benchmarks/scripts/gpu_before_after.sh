#!/usr/bin/env bash
# Issue 46's check on one H200, in one device call, output under $OUT: the GPU tests of this tree,
# then the three figures that must not move (bench serve's decode-heavy and prefill-heavy loads, bench
# e2e at batch 1), each run with the package before the restructure (.carry/before, made here by
#   git archive 475dd08 fp8route | tar -x -C .carry/before
# ) and with this tree, alternated, on one random Llama-3.1-8B FP8 checkpoint. PHASES picks: tests serve e2e;
# TESTS names the tests (default tests/gpu), DECODE_PROMPTS and PREFILL_PROMPTS size the two loads.
set -u -o pipefail
log="$OUT/gpu.txt"
echo "# PHASES='${PHASES:=tests serve e2e}' bash benchmarks/scripts/gpu_before_after.sh ($(date -u +%FT%TZ))" | tee "$log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log"
export PYTHONUNBUFFERED=1
ckpt=/tmp/ckpt-8b
[[ " $PHASES " =~ " serve "|" e2e " ]] && [ ! -f $ckpt/config.json ] && PYTHONPATH=$PWD python3 -c "
from pathlib import Path
from fp8route.checkpoint.random import write_random
from fp8route.models.shapes import MODELS
write_random(Path('$ckpt'), MODELS['llama-3.1-8b'], fp8=True)" 2>&1 | tail -1
arms() {  # name, then the command after python3 -m fp8route: once per tree, before first
    local name=$1; shift
    for tree in before after; do
        local root=$PWD; [ $tree = before ] && root=$PWD/.carry/before
        mkdir -p "$OUT/$tree"
        # -P: python3 -m puts the working directory (this tree) ahead of PYTHONPATH; the before arm
        # must import the package under $root, which each log's first line names.
        PYTHONPATH=$root python3 -P -c "import fp8route; print('fp8route from', fp8route.__file__)" \
            > "$OUT/$tree/$name.log" 2>&1
        # shellcheck disable=SC2068
        PYTHONPATH=$root timeout "${ARM_TIMEOUT:-200}" python3 -P -m fp8route $@ --out "$OUT/$tree" \
            >> "$OUT/$tree/$name.log" 2>&1
        echo "== $name $tree (rc $?): $(head -1 "$OUT/$tree/$name.log")" | tee -a "$log"
        mv "$OUT/$tree"/*-ckpt-8b.json "$OUT/$tree/$name.json" 2>/dev/null
        rm -f "$OUT/$tree"/*.png
    done
}
for phase in $PHASES; do
    case $phase in
    tests)
        # shellcheck disable=SC2086
        PYTHONPATH=$PWD timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q ${TESTS:-tests/gpu} -n "${WORKERS:-4}" -rfE \
            --tb=short -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
        echo "== tests (rc $?)" | tee -a "$log"
        tail -2 "$OUT/gpu_tests.log" | tee -a "$log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | tee -a "$log" ;;
    serve)
        arms decode bench serve $ckpt --max-model-len 8192 --policy routed --num-prompts "${DECODE_PROMPTS:-1024}" \
            --input-len 512:1536 --output-len 128:512
        arms prefill bench serve $ckpt --max-model-len 8192 --policy routed --num-prompts "${PREFILL_PROMPTS:-256}" \
            --input-len 1024:4096 --output-len 32:32 ;;
    e2e)
        arms e2e bench e2e $ckpt --batch 1 --input 1024,4096 --output 64 --policy routed ;;
    esac
done
# A call returns 8 files: each tree's logs go into one, its JSONs stay.
for tree in before after; do
    [ -d "$OUT/$tree" ] || continue
    for f in "$OUT/$tree"/*.log; do echo "=== $(basename "$f")"; cat "$f"; rm "$f"; done > "$OUT/$tree.log"
done
PYTHONPATH=$PWD python3 benchmarks/scripts/before_after_table.py "$OUT" | tee -a "$log"
