#!/usr/bin/env bash
# One call on nvidia-h200-x2: `fp8route generate --tp 2` on CUDA against --tp 1, on a tiny random
# Llama with a byte-level tokenizer (the CLI test's model), greedy; the two outputs must be equal.
set -u -o pipefail
export PYTHONPATH=$PWD:$PWD/tests PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DIR=${DIR:-/tmp/tpgen}
rm -rf "$DIR"
python3 - "$DIR" <<'PY'
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
for tp in ${TPS:-1 2}; do
  timeout ${GEN_TIMEOUT:-120} python3 -m fp8route generate "$DIR/fp8" --prompt "the theme" --max-new-tokens 24 --tp $tp \
    > "$OUT/tp$tp.out" 2> "$OUT/tp$tp.err"
  echo "tp=$tp rc=$?"; tail -3 "$OUT/tp$tp.err"
done
cmp "$OUT/tp1.out" "$OUT/tp2.out" && echo "same text from --tp 1 and --tp 2"
