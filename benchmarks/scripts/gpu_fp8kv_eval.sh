#!/usr/bin/env bash
# Issue 28's accuracy must-show in one device call: SmolLM2-135M-Instruct FP8 (ModelOpt) with
# calibrated KV scales, every HellaSwag (10042) and ARC-Easy test (2376) question and the held-out
# text, the bf16 KV cache against the fp8 one (`fp8route eval --kv-cache-dtype auto,fp8`, paired).
#
# Data: as gpu_eval.sh (pack_eval_carry.sh here; device call 1 carries .carry/part1 and stashes it,
# this call carries .carry/part2). The checkpoint is made there as the CPU one was
# (benchmarks/results/cpu/fp8_kv/COMMAND.md), on the GPU.
# Output: $OUT/fp8kv_eval/{run.log,hellaswag.json,arc_easy_test.json,text.json}.
set -euo pipefail
[ -d benchmarks/scripts ] && [ -d fp8route ] || { echo "gpu_fp8kv_eval: run it from the repo root" >&2; exit 2; }
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/fp8kv-out}
WORK=${WORK:-/tmp/fp8kv}
BATCH=${BATCH:-128}
DEVICE=${DEVICE:-cuda}
LIMIT=${LIMIT:-}  # empty: every question
HARD_STOP=${HARD_STOP:-500}
HELDOUT=benchmarks/results/heldout/boolq_val_passages.txt
RES=$OUT/fp8kv_eval
mkdir -p "$RES"
source benchmarks/scripts/eval_site.sh

main() {
  echo "# bash benchmarks/scripts/gpu_fp8kv_eval.sh ($(date -u +%FT%TZ), commit ${COMMIT:-unknown})"
  [ "$DEVICE" != cuda ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  site_packages
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  rm -rf "$WORK" && mkdir -p "$WORK"
  local t0=$SECONDS
  "$PY" - "$WORK/smollm2-fp8-kv" "$DEVICE" <<'EOF'
import sys

import torch

from fp8route.checkpoint.quantize import quantize_checkpoint
from fp8route.checkpoint.smollm2 import CALIBRATION, smollm2_folder
from fp8route.models.tokenizer import load_tokenizer

bf16 = smollm2_folder(fp8=False)
tok = load_tokenizer(bf16)
calib = [torch.tensor(tok.encode(t).ids) for t in CALIBRATION]
report = quantize_checkpoint(bf16, sys.argv[1], format="modelopt", calib=calib, device=sys.argv[2], kv_cache="fp8")
scales = report.kv_scales
print(f"{len(scales)} KV scales, {min(scales.values()):.5f} .. {max(scales.values()):.5f}")
EOF
  echo "checkpoint in $((SECONDS - t0)) s"
  local ckpt=$WORK/smollm2-fp8-kv
  run_eval() {  # NAME ARGS...
    local name=$1 rc=0
    shift
    timeout -k 10 "$HARD_STOP" "$PY" -m fp8route eval "$ckpt" --kv-cache-dtype auto,fp8 --device "$DEVICE" \
      --batch-size "$BATCH" --quiet ${LIMIT:+--limit "$LIMIT"} --out "$WORK/$name" "$@" > "$WORK/$name.log" 2>&1 || rc=$?
    echo "-- $name: exit $rc after $((SECONDS - t0)) s"
    cat "$WORK/$name.log"
  }
  run_eval hellaswag --task hellaswag &
  local hs=$!
  run_eval arc --task arc_easy_test --text "$HELDOUT" &
  wait $hs || true
  wait || true
  local f
  for f in "$WORK"/hellaswag/*.json "$WORK"/arc/*.json; do  # '@' in a name does not come back from $OUT
    [ -f "$f" ] && cp "$f" "$RES/$(basename "$f" | cut -d- -f1).json"
  done
  ls "$RES"
}

main 2>&1 | tee "$RES/run.log"
