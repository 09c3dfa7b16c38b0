#!/usr/bin/env bash
# Issue 47's mixed-step host time (and issue 49's cost beside it) in one device call, output under $OUT.
# PHASES, in order: profile (mixed_host_profile.py on the working tree: where the host's time goes in
# steps with prefill chunks), tests (TESTS: GPU test files; test_step_split_gpu.py last, it keeps most of
# the memory), decode and prefill (bench serve's decode-heavy and prefill-heavy loads with the tree
# before the change, BEFORE, a commit whose fp8route comes from git archive; the working tree; the
# working tree in deterministic mode), e2e (bench e2e, routed against deterministic, batch 1 and 16 at
# 4096 in). Each phase under its own timeout; a short table last.
set -u -o pipefail
: "${PHASES:=profile tests decode e2e prefill}" "${BEFORE:=f26d1a8}" "${TESTS:=tests/gpu/test_engine_gpu.py tests/gpu/test_fp8_kv_gpu.py tests/engine/test_client_controls.py tests/engine/test_mixed_step.py tests/gpu/test_step_split_gpu.py}"
: "${DECODE_PROMPTS:=256}" "${PREFILL_PROMPTS:=64}" "${ARM_TIMEOUT:=100}"
log="$OUT/gpu.txt"
echo "# PHASES='$PHASES' BEFORE=$BEFORE bash benchmarks/scripts/gpu_mixed_host.sh ($(date -u +%FT%TZ)), tree $(git rev-parse --short HEAD)" | tee "$log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$log"
export PYTHONUNBUFFERED=1
ckpt=/tmp/ckpt-8b-tensor
[ -f "$ckpt/config.json" ] || PYTHONPATH=$PWD python3 -c "
from pathlib import Path
from fp8route.checkpoint.random import write_random
from fp8route.models.shapes import MODELS
write_random(Path('$ckpt'), MODELS['llama-3.1-8b'], fp8=True, scheme='tensor')" > /dev/null 2>&1
before=/tmp/before-tree
rm -rf "$before" && mkdir -p "$before" && git archive "$BEFORE" fp8route | tar -x -C "$before"
serve() {  # name, then bench serve's load arguments
    local name=$1 arm tree flag
    shift
    for arm in before after after-det; do
        tree=$PWD; flag=
        [ "$arm" = before ] && tree=$before
        [ "$arm" = after-det ] && flag=--deterministic
        # -P: python3 -m would put this directory (the working tree) ahead of PYTHONPATH, before arm included
        PYTHONPATH=$tree timeout "$ARM_TIMEOUT" python3 -P -m fp8route bench serve "$ckpt" --max-model-len 8192 $flag "$@" \
            --out "$OUT/serve-$name-$arm" > "$OUT/serve-$name-$arm.log" 2>&1
        echo "== serve $name $arm (rc $?)" | tee -a "$log"
        grep -E "^routed  |prefill chunks" "$OUT/serve-$name-$arm.log" | tee -a "$log"
        rm -f "$OUT/serve-$name-$arm"/*.png
    done
}
for phase in $PHASES; do
    case $phase in
    profile)
        PYTHONPATH=$PWD timeout 150 python3 benchmarks/scripts/mixed_host_profile.py "$ckpt" --prompts 64 \
            > "$OUT/profile.txt" 2>&1
        echo "== profile (rc $?)" | tee -a "$log"
        grep -A 5 "== mixed" "$OUT/profile.txt" | cut -c1-150 | tee -a "$log" ;;
    tests)
        PYTHONPATH=$PWD timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider $TESTS \
            > "$OUT/tests.log" 2>&1
        echo "== tests (rc $?)" | tee -a "$log"
        tail -1 "$OUT/tests.log" | tee -a "$log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | tee -a "$log" ;;
    decode) serve decode --num-prompts "$DECODE_PROMPTS" --input-len 512:1536 --output-len 128:512 ;;
    prefill) serve prefill --num-prompts "$PREFILL_PROMPTS" --input-len 1024:4096 --output-len 32:32 ;;
    e2e)
        PYTHONPATH=$PWD timeout "${E2E_TIMEOUT:-150}" python3 -m fp8route bench e2e "$ckpt" --batch 1,16 --input 4096 \
            --output 64 --policy routed,deterministic --out "$OUT" > "$OUT/e2e.log" 2>&1
        echo "== e2e (rc $?)" | tee -a "$log"
        sed -n '/^arm /,/^$/p' "$OUT/e2e.log" | tee -a "$log"
        rm -f "$OUT"/*.png ;;
    esac
done
