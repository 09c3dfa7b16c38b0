"""Where a serving step's host time goes: the engine's loop under cProfile on a prefill-heavy load,
then the same with CUDA's sync debug mode on, which reports every operation that waits for the GPU.

    python3 benchmarks/engine_profile.py CHECKPOINT [--prompts 32]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import warnings

import torch

from fp8route.engine.llm import LLM
from fp8route.engine.serve_bench import drive
from fp8route.engine.workload import make_load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--prompts", type=int, default=32)
    args = parser.parse_args()
    llm = LLM(args.folder, max_model_len=8192, skip_tokenizer_init=True, record_stats=True)
    vocab = llm.model.cfg.vocab_size
    drive(llm, make_load(8, (1024, 4096), (2, 4), vocab, seed=1))  # warm-up
    llm.engine.stats.clear()
    load = make_load(args.prompts, (1024, 4096), (16, 16), vocab, seed=2)
    profile = cProfile.Profile()
    profile.enable()
    _, seconds, _ = drive(llm, load)
    profile.disable()
    stats = llm.engine.stats
    prefill = [s for s in stats if s.prefill_tokens]
    print(
        f"{len(stats)} steps in {seconds:.2f} s; prefill steps {len(prefill)}: host ms mean "
        f"{1e3 * sum(s.host_s for s in prefill) / max(1, len(prefill)):.1f}, wall ms mean "
        f"{1e3 * sum(s.wall_s for s in prefill) / max(1, len(prefill)):.1f}"
    )
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(order).print_stats(28)
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
