#!/usr/bin/env bash
# Issue 45 on a CPU: SmolLM2-135M-Instruct in each FP8 scheme against its bf16 conversion, on the
# first LIMIT ARC-Easy and HellaSwag validation questions and the held-out text, in one `fp8route eval`
# (every model on the same batches). Run from the repository root, its output kept as OUT's run.log;
# writes the eval JSONs and the FP8 folders' quantization records (records.json) under OUT.
set -euo pipefail
OUT=${OUT:-benchmarks/results/cpu/schemes_accuracy}
WORK=${WORK:-/tmp/schemes_accuracy}
LIMIT=${LIMIT:-200}
HELDOUT=benchmarks/results/heldout/boolq_val_passages.txt
CALIB_TXT=benchmarks/results/cpu/calibration/calib.txt
mkdir -p "$OUT" "$WORK"
rm -rf "$WORK"/tensor "$WORK"/tensor-calibtxt "$WORK"/channel "$WORK"/block
echo "# $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo '+dirty'); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
python3 -c "import torch; print('torch', torch.__version__, '| eval threads: cores - 1 unless OMP_NUM_THREADS:', __import__('os').environ.get('OMP_NUM_THREADS', 'unset'))"

BF16=$(python3 -c "from fp8route.checkpoint.smollm2 import smollm2_folder; print(smollm2_folder(fp8=False))")
# The token ids smollm2_folder(fp8=True) calibrates `fp8route generate smollm2`'s model on: its 4
# CALIBRATION texts, each tokenized on its own (146 tokens), so the tensor arm is that model.
python3 -c "
import json, sys
from fp8route.checkpoint.smollm2 import CALIBRATION
from fp8route.models.tokenizer import load_tokenizer
tokenizer = load_tokenizer(sys.argv[1])
print(json.dumps([tokenizer.encode(text).ids for text in CALIBRATION]))
" "$BF16" > "$WORK/smollm2_calibration_ids.json"

step() { local t0=$SECONDS; echo "+ $*"; "$@"; echo "  ($((SECONDS - t0)) s)"; }
step fp8route quantize "$BF16" "$WORK/tensor" --scheme tensor --calib "$WORK/smollm2_calibration_ids.json" --device cpu
step fp8route quantize "$BF16" "$WORK/tensor-calibtxt" --scheme tensor --calib-text "$CALIB_TXT" --device cpu
step fp8route quantize "$BF16" "$WORK/channel" --scheme channel --device cpu
step fp8route quantize "$BF16" "$WORK/block" --scheme block --device cpu
python3 -c "
import json, sys
arms = ('block', 'channel', 'tensor', 'tensor-calibtxt')
print(json.dumps({a: json.load(open(f'{sys.argv[1]}/{a}/config.json'))['quantization_config'] for a in arms}, indent=1))
" "$WORK" > "$OUT/records.json"
step fp8route eval "$BF16" --task arc_easy --task hellaswag --text "$HELDOUT" --limit "$LIMIT" --device cpu \
    --compare "$WORK/tensor" --compare "$WORK/tensor-calibtxt" --compare "$WORK/channel" --compare "$WORK/block" \
    --out "$OUT" --quiet
{ echo "# summary: python3 benchmarks/scripts/eval_table.py $OUT"; python3 benchmarks/scripts/eval_table.py "$OUT"
  echo; echo "# against tensor: python3 benchmarks/scripts/schemes_against_tensor.py"
  python3 benchmarks/scripts/schemes_against_tensor.py; } > "$OUT/tables.txt"
echo "# done $(date -u +%FT%TZ); load $(cut -d' ' -f1-3 /proc/loadavg)"
