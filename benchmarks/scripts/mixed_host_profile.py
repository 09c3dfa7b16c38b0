"""Where the host's time goes in steps that carry prefill chunks (issue 47): bench serve's decode-heavy
load driven through the engine, each engine.step() under its own cProfile; the profiles of the steps
that launched prefill chunks are merged and printed by own time and by cumulative time, against the
decode-only steps' (the engine's own host_s per kind too).

    python3 benchmarks/scripts/mixed_host_profile.py CKPT [--prompts 64] [--deterministic] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
from pathlib import Path

from fp8route.bench.serve import sampling_params
from fp8route.bench.workload import make_load
from fp8route.engine.config import EngineConfig
from fp8route.engine.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    config = EngineConfig(max_model_len=8192, skip_tokenizer_init=True, record_stats=True,
                          deterministic=args.deterministic)  # fmt: skip
    llm = LLM(args.path, config=config)
    engine = llm.engine
    vocab = engine.model.cfg.vocab_size
    for label, prompts in (("warm-up", 16), ("load", args.prompts)):
        load = make_load(prompts, (512, 1536), (64, 128), vocab, seed=len(label))
        for index, item in enumerate(load):
            engine.add_request(item.prompt_ids, sampling_params("greedy", item, index))
        kinds: dict[str, pstats.Stats | None] = {"mixed": None, "decode": None}
        host: dict[str, list[float]] = {"mixed": [], "decode": []}
        while engine.has_unfinished:
            before = len(engine.stats)
            profile = cProfile.Profile()
            profile.enable()
            engine.step()
            profile.disable()
            if len(engine.stats) == before:
                continue
            stats = engine.stats[-1]
            kind = "mixed" if stats.prefill_tokens else "decode"
            host[kind].append(stats.host_s)
            merged = kinds[kind]
            if merged is None:
                kinds[kind] = pstats.Stats(profile)
            else:
                merged.add(profile)
    for kind, merged in kinds.items():
        if merged is None:
            continue
        steps = len(host[kind])
        print(f"== {kind} steps: {steps}, engine host_s mean {1e3 * statistics.fmean(host[kind]):.2f} ms")
        for order in ("tottime", "cumulative"):
            merged.stream = text = io.StringIO()
            merged.sort_stats(order).print_stats(22)
            print(text.getvalue().split("\n", 6)[-1])
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            merged.dump_stats(args.out / f"{kind}.pstats")


if __name__ == "__main__":
    main()
