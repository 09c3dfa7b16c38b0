"""The static generate at the sizes that used to stop with an illegal memory access (a SiLU x up
kernel's int32 offsets past 2^31 elements): 256 prompts of 1024 tokens, and 16 of 8192 (load_model's
default capacity). Each must complete, and its tokens must be those of the same rows run in smaller
batches (the first 4 rows, alone).

    python3 benchmarks/generate_large.py CHECKPOINT
"""

from __future__ import annotations

import sys
import time

import torch

from fp8route.engine import load_model


def main(folder: str) -> None:
    for batch, length, new in ((256, 1024, 8), (16, 8192, 8)):
        model = load_model(folder, "cuda", max_batch_size=batch, max_seq_len=length + new)
        ids = torch.randint(0, model.cfg.vocab_size, (batch, length), device="cuda")
        start = time.perf_counter()
        out = model.generate(ids, new)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        few = model.generate(ids[:4], new)
        same = torch.equal(out[:4], few)
        print(
            f"generate {batch} x {length} + {new}: completed in {seconds:.2f} s "
            f"({batch * length / seconds:.0f} prompt tok/s); first 4 rows equal to running them alone: {same}",
            flush=True,
        )
        del model, out, few
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
