"""Decode step time with the next GEMM's weight prefetched into L2 (fp8route.models.prefetch), per
prefetch budget, against no prefetch, in one process: a random checkpoint of real dimensions, the
step replayed from its CUDA graph (re-captured per budget), budgets interleaved over rounds.

    python3 benchmarks/prefetch_bench.py [--model llama-3.1-8b] [--batch 1,16] [--context 1024]
        [--budgets 0,4,8,16,32] (MiB) [--rounds 3] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from fp8route.checkpoint.random import write_random
from fp8route.models.load import load_model
from fp8route.models.shapes import MODELS

MIB = 2**20


def step_ms(model, tokens: torch.Tensor, positions: torch.Tensor, steps: int) -> float:  # noqa: ANN001
    for _ in range(10):
        model.step(tokens, positions)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        model.step(tokens, positions)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--budgets", default="0,4,8,16,32", help="MiB of each weight to prefetch (0: none)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tmp", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        folder = write_random(Path(tmp) / "fp8", dict(MODELS[args.model]), fp8=True)
        model = load_model(folder, device, max_batch_size=max(batches), max_seq_len=args.context + 64)
    times: dict[tuple[int, int], list[float]] = {(b, m): [] for b in batches for m in budgets}
    agree: dict[tuple[int, int], bool] = {}
    for batch in batches:
        ids = torch.randint(0, model.cfg.vocab_size, (batch, args.context), device=device)
        model.generate(ids, 2)  # fills the cache rows the steps attend to
        tokens = ids[:, -1].contiguous()
        positions = torch.full((batch,), args.context, dtype=torch.int64, device=device)
        reference = None
        for _ in range(args.rounds):
            for mib in budgets:
                model.prefetch.budget = mib * MIB
                model._graphs = None  # re-captured with this budget's prefetches
                logits, _ = model.step(tokens, positions)
                if reference is None:
                    reference = logits.clone()
                agree[batch, mib] = agree.get((batch, mib), True) and torch.equal(logits, reference)
                times[batch, mib].append(step_ms(model, tokens, positions, args.steps))
    print(f"prefetches captured: {model.prefetch.issued}")
    print(f"\n{args.model}, context {args.context}, {args.rounds} rounds x {args.steps} graph replays")
    print(f"{'batch':>5} {'MiB':>4} {'step ms':>8} {'min':>7} {'max':>7} {'x none':>7}  logits")
    for batch in batches:
        base = statistics.median(times[batch, budgets[0]])
        for mib in budgets:
            t = times[batch, mib]
            med = statistics.median(t)
            same = "identical" if agree[batch, mib] else "DIFFER"
            print(f"{batch:>5} {mib:>4} {med:8.3f} {min(t):7.3f} {max(t):7.3f} {base / med:7.3f}  {same}")


if __name__ == "__main__":
    main()
