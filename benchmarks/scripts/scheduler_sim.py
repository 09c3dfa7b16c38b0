"""The engine's scheduler alone on a load, no model: how many steps it takes, how many rows each
decodes, and what preemption costs in tokens computed again, for a pool of a given size. Issue 47's
1000/1000 throughput load (1536 prompts, max_num_seqs 1024) is the default; --pool-tokens is what the
engine's start-up line says its KV pool holds on the GPU in question.

    python benchmarks/scripts/scheduler_sim.py --pool-tokens 1850000
"""

from __future__ import annotations

import argparse
import random
import statistics

from fp8route.engine.config import EngineConfig
from fp8route.engine.request import Request, RequestMetrics
from fp8route.engine.sampling import SamplingParams
from fp8route.engine.scheduler import Scheduler


def simulate(args: argparse.Namespace) -> dict[str, float]:
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget, max_model_len=args.input + args.output,
        block_size=args.block_size, enable_prefix_caching=True,
    )  # fmt: skip
    s = Scheduler(config, args.pool_tokens // args.block_size + 1)
    rng = random.Random(0)
    for i in range(args.prompts):  # distinct prompts: nothing shared but what a recompute finds cached
        prompt = [rng.randrange(1, 120_000) for _ in range(args.input)]
        params = SamplingParams(max_tokens=args.output, ignore_eos=True)
        s.add(Request(str(i), prompt, params, 0, RequestMetrics(0.0), max_tokens=args.output))
    steps = computed = decode_rows = 0
    rows: list[int] = []
    while s.waiting or s.running:
        out = s.schedule()
        steps += 1
        known = {r.request_id: r for r in s.running}
        singles = sum(1 for p in out.seqs if p.num_tokens == 1)
        rows.append(singles)
        decode_rows += singles
        for piece in out.seqs:
            computed += piece.num_tokens
            request = known[piece.request_id]
            s.computed(request, piece)
            if piece.samples:
                request.num_pending -= 1
                request.token_ids.append(7)
                if len(request.output_token_ids) >= args.output:
                    s.finish(request, "length")
        if steps > 100 * (args.input + args.output):
            raise RuntimeError("the load does not drain")
    needed = args.prompts * (args.input + args.output - 1)
    return {
        "steps": steps,
        "preemptions": s.preemptions,
        "tokens computed": computed,
        "of them again (preemption)": computed - needed,
        "share computed again": (computed - needed) / needed,
        "decode rows a step (mean over steps with any)": statistics.fmean(r for r in rows if r) if decode_rows else 0,
        "steps with 1000+ decode rows": sum(r >= 1000 for r in rows),
        "prefix hits (tokens)": s.blocks.stats.hit_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-tokens", type=int, required=True)
    parser.add_argument("--prompts", type=int, default=1536)
    parser.add_argument("--input", type=int, default=1000)
    parser.add_argument("--output", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    for name, value in simulate(parser.parse_args()).items():
        print(f"{name}: {value:,.3f}" if isinstance(value, float) else f"{name}: {value:,}")


if __name__ == "__main__":
    main()
