"""The static generate at the sizes that used to stop with an illegal memory access (a SiLU x up
kernel's int32 offsets past 2^31 elements): 256 prompts of 1024 tokens, and 16 of 8192 (load_model's
default capacity). Each must complete; its first 4 rows' prompt logits are compared with those rows
prefilled alone (the same within the rounding of other GEMM sizes: random weights make near-ties of
every token, so the generated tokens themselves need not agree).

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
        lengths = torch.full((batch,), length, device="cuda")
        many = model.prefill(ids, lengths)[:4].float()
        few = model.prefill(ids[:4], lengths[:4]).float()
        rel = ((many - few).norm() / few.norm()).item()
        print(
            f"generate {batch} x {length} + {new}: completed in {seconds:.2f} s ({batch * length / seconds:.0f} "
            f"prompt tok/s, first call); {out.shape[1] - length} new tokens a row; first 4 rows' logits vs alone: "
            f"relative difference {rel:.1e}",
            flush=True,
        )
        del model, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
