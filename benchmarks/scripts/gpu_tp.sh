#!/usr/bin/env bash
# One call on nvidia-h200-x2, output under $OUT. PHASES (default "e2e") lists, in order:
#   tune:     Llama-3.1-8B's TP2 shapes tuned into a copy of the shipped H200 table (FP8ROUTE_TABLE for
#             the phases after it), float and pre-quantized x
#   e2e:      fp8route bench e2e with TP1 and TP2 side by side on a random Llama-3.1-8B checkpoint
#             (METHODS: the all-reduce methods, BATCH, INPUT, OUTPUT, ARMS)
#   generate: `fp8route generate --tp 2` against --tp 1 on a tiny random Llama with a byte-level tokenizer
#             (the CLI test's model), greedy: the two texts must be equal
# NVLink multicast stays off. The all-reduce microbenchmark and the per-kernel decode profile of the
# TP2 results are in git history: git show befbbf5:benchmarks/allreduce_bench.py (and tp_decode_profile.py).
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PHASES=${PHASES:-e2e}
log="$OUT/run.log"
{
  echo "# PHASES='$PHASES' bash benchmarks/scripts/gpu_tp.sh   ($(date -u +%FT%TZ), commit ${COMMIT:-unknown})"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m || true
} 2>&1 | tee "$log"
for phase in $PHASES; do
  case $phase in
  tune)
    export FP8ROUTE_TABLE=$OUT/routing-h200.json
    cp fp8route/routing/defaults/h200.json "$FP8ROUTE_TABLE"
    { python3 -m fp8route tune --model llama-3.1-8b --tp 2 | tail -25
      python3 -m fp8route tune --model llama-3.1-8b --tp 2 --x-quantized | tail -5; } 2>&1 | tee -a "$log" ;;
  e2e)
    timeout "${E2E_TIMEOUT:-440}" python3 -m fp8route bench e2e --random llama-3.1-8b --tp 1,2 \
      --all-reduce "${METHODS:-nccl,symm_mem}" --batch "${BATCH:-1,16}" --input "${INPUT:-4096}" --output "${OUTPUT:-64}" \
      --policy "${ARMS:-routed}" --tmp /tmp --out "$OUT" 2>&1 | tee -a "$log" ;;
  generate)
    DIR=${DIR:-/tmp/tpgen}
    rm -rf "$DIR"
    PYTHONPATH=$PWD:$PWD/tests python3 - "$DIR" <<'PY' 2>&1 | tee -a "$log"
import sys
from pathlib import Path
from checkpoint_helpers import TINY, llama_tensors, synthetic_gguf_metadata, write_checkpoint
from fp8route import quantize_checkpoint
from fp8route.checkpoint.gguf_tokenizer import write_tokenizer
root = Path(sys.argv[1])
metadata = synthetic_gguf_metadata()
config = dict(TINY, vocab_size=len(metadata["tokenizer.ggml.tokens"]), eos_token_id=2)
bf16 = write_checkpoint(root / "bf16", llama_tensors(config), config)
write_tokenizer(metadata, bf16)
print(quantize_checkpoint(bf16, root / "fp8", format="modelopt", device="cuda").dst)
PY
    for tp in 1 2; do
      timeout "${GEN_TIMEOUT:-120}" python3 -m fp8route generate "$DIR/fp8" --prompt "the theme" --max-new-tokens 24 \
        --tp $tp > "$OUT/tp$tp.out" 2> "$OUT/tp$tp.err"
      echo "tp=$tp rc=$?"; tail -3 "$OUT/tp$tp.err"
    done 2>&1 | tee -a "$log"
    cmp "$OUT/tp1.out" "$OUT/tp2.out" && echo "same text from --tp 1 and --tp 2" | tee -a "$log" ;;
  esac
done
