"""Where a serving step's host time goes: the engine's loop under cProfile on a prefill-heavy load,
then the same with CUDA's sync debug mode on, which reports every operation that waits for the GPU.

    python3 benchmarks/engine_profile.py CHECKPOINT [--prompts 32] [--input-len 1024:4096] [--output-len 16]
        [--request-rate R] [--max-num-batched-tokens N] [--mixed-steps] [--async-scheduling on|off]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import warnings

import torch

from fp8route.engine.llm import LLM
from fp8route.bench.serve import drive
from fp8route.bench.workload import make_load


def span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--input-len", type=span, default=(1024, 4096))
    parser.add_argument("--output-len", type=span, default=(16, 16))
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--mixed-steps", action="store_true")
    parser.add_argument("--async-scheduling", choices=("on", "off"), default="on", help="the library's default: on")
    args = parser.parse_args()
    llm = LLM(
        args.folder, max_model_len=8192, skip_tokenizer_init=True, record_stats=True,
        max_num_batched_tokens=args.max_num_batched_tokens, mixed_steps=args.mixed_steps,
        async_scheduling=args.async_scheduling == "on",
    )  # fmt: skip
    vocab = llm.model.cfg.vocab_size
    drive(llm, make_load(8, args.input_len, (2, 4), vocab, seed=1))  # warm-up
    llm.engine.stats.clear()
    load = make_load(args.prompts, args.input_len, args.output_len, vocab, request_rate=args.request_rate, seed=2)
    profile = cProfile.Profile()
    profile.enable()
    _, seconds, _ = drive(llm, load)
    profile.disable()
    stats = llm.engine.stats
    for kind, steps in (
        ("prefill", [s for s in stats if s.prefill_tokens]),
        ("decode", [s for s in stats if not s.prefill_tokens]),
    ):
        print(
            f"{kind} steps {len(steps)}: host ms mean {1e3 * sum(s.host_s for s in steps) / max(1, len(steps)):.1f}, "
            f"wall ms mean {1e3 * sum(s.wall_s for s in steps) / max(1, len(steps)):.1f}"
        )
    print(f"{len(stats)} steps in {seconds:.2f} s")
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(order).print_stats(35)
        print(out.getvalue())
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drive(llm, make_load(4, (1024, 4096), (4, 4), vocab, seed=3))
    torch.cuda.set_sync_debug_mode(0)
    seen: dict[str, int] = {}
    for w in caught:
        where = f"{w.filename}:{w.lineno}: {str(w.message)[:200]}"
        seen[where] = seen.get(where, 0) + 1
    print(f"synchronizing operations ({sum(seen.values())} in all):")
    for message, count in sorted(seen.items(), key=lambda kv: -kv[1])[:20]:
        print(f"{count:6d}  {message}")


if __name__ == "__main__":
    main()
