"""Prefill eager against prefill under torch.compile, on a random FP8 checkpoint of a real model's
dimensions, in one process: which one load_model's prefill should run.

Compiled, the GEMMs stay the routed custom ops (opaque to inductor); what inductor can change is
everything between them (norms, RoPE, SiLU x up, the activation quantizer) and the host cost.

    python3 benchmarks/prefill_compile.py [--model llama-3.1-8b] [--shapes 1x1024,1x4096,8x1024]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fp8route.checkpoint.random import write_random
from fp8route.bench.e2e import timed_calls
from fp8route.engine.load import load_model
from fp8route.models.shapes import MODELS
from fp8route.routing.fingerprint import Fingerprint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b", choices=list(MODELS))
    parser.add_argument("--shapes", default="1x1024,1x4096,8x1024", help="batch x prompt tokens")
    parser.add_argument("--tmp", help="where the random checkpoint is written")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"on {Fingerprint.of('cuda').summary()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="fp8route-compile-", dir=args.tmp) as tmp:
        folder = write_random(Path(tmp) / "fp8", MODELS[args.model], fp8=True)
        rows, tokens = max(b for b, _ in shapes), max(t for _, t in shapes)
        model = load_model(folder, "cuda", max_batch_size=rows, max_seq_len=tokens)
    compiled = torch.compile(model.prefill, dynamic=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'shape':>8}{'eager ms':>10}{'compiled ms':>13}{'eager/compiled':>16}{'compile s':>11}{'max |diff|':>12}")
    with torch.no_grad():
        for b, t in shapes:
            ids = torch.randint(0, model.cfg.vocab_size, (b, t), device="cuda", generator=gen)
            lengths = torch.full((b,), t, device="cuda", dtype=torch.int64)
            start = time.perf_counter()
            compiled(ids, lengths)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - start
            # Alternating arms, each warmed up: neither one always runs on a cooler GPU.
            eager, fast = functools.partial(model.prefill, ids, lengths), functools.partial(compiled, ids, lengths)
            eager_times, eager_out = timed_calls(eager, args.repeats)
            compiled_times, compiled_out = timed_calls(fast, args.repeats)
            eager_again, _ = timed_calls(eager, args.repeats)
            eager_ms = statistics.median(eager_times + eager_again) * 1e3
            compiled_ms = statistics.median(compiled_times) * 1e3
            diff = (eager_out.float() - compiled_out.float()).abs().max().item()  # type: ignore[union-attr]
            print(
                f"{b}x{t:>6}{eager_ms:>10.2f}{compiled_ms:>13.2f}{eager_ms / compiled_ms:>16.3f}"
                f"{compile_s:>11.1f}{diff:>12.3g}",
                f"  spread eager {spread(eager_times + eager_again)}, compiled {spread(compiled_times)}",
                flush=True,
            )


def spread(times: list[float]) -> str:
    return f"{100 * (max(times) - min(times)) / statistics.median(times):.0f}%"


if __name__ == "__main__":
    main()
