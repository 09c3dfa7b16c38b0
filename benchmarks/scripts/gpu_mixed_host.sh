#!/usr/bin/env bash
# Issue 47's mixed-step host time in one device call, output under $OUT: mixed_host_profile.py on the
# working tree (where the host's time goes in steps with prefill chunks), then bench serve's
# decode-heavy and prefill-heavy loads with the tree before the change (BEFORE, a commit: its fp8route
# from git archive), the working tree, and the working tree in deterministic mode. A short table last.
set -u -o pipefail
: "${BEFORE:=HEAD}" "${DECODE_PROMPTS:=256}" "${PREFILL_PROMPTS:=64}" "${ARM_TIMEOUT:=120}"
log="$OUT/gpu.txt"
echo "# BEFORE=$BEFORE bash benchmarks/scripts/gpu_mixed_host.sh ($(date -u +%FT%TZ)), tree $(git rev-parse --short HEAD) + working changes" | tee "$log"
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
PYTHONPATH=$PWD timeout 150 python3 benchmarks/scripts/mixed_host_profile.py "$ckpt" --prompts 64 \
    > "$OUT/profile.txt" 2>&1
echo "== profile (rc $?)" | tee -a "$log"
grep -A 6 "== mixed" "$OUT/profile.txt" | cut -c1-150 | tee -a "$log"
for load in "decode --num-prompts $DECODE_PROMPTS --input-len 512:1536 --output-len 128:512" \
            "prefill --num-prompts $PREFILL_PROMPTS --input-len 1024:4096 --output-len 32:32"; do
    set -- $load
    name=$1; shift
    for arm in before after after-det; do
        tree=$PWD; flag=
        [ "$arm" = before ] && tree=$before
        [ "$arm" = after-det ] && flag=--deterministic
        PYTHONPATH=$tree timeout "$ARM_TIMEOUT" python3 -m fp8route bench serve "$ckpt" --max-model-len 8192 $flag "$@" \
            --out "$OUT/serve-$name-$arm" > "$OUT/serve-$name-$arm.log" 2>&1
        echo "== serve $name $arm (rc $?)" | tee -a "$log"
        grep -E "^routed  |prefill chunks" "$OUT/serve-$name-$arm.log" | tee -a "$log"
        rm -f "$OUT/serve-$name-$arm"/*.png
    done
done
