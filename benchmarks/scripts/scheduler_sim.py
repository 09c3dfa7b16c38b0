"""The engine's scheduler alone on a load, no model: how many steps it takes, how many rows each
decodes, what preemption costs in tokens computed again for a pool of a given size, and an estimate of
the load's time from a step-time model (its three rates are arguments: an H100's by default). Issue 47's
1000/1000 throughput load (1536 prompts, max_num_seqs 1024) is the default; --pool-tokens is what the
engine's start-up line says its KV pool holds on the GPU in question. --reserve runs the engine's
admission="reserve" (a request admitted only while the pool holds every running one to its max_tokens,
as TensorRT-LLM's "guaranteed no evict"); --eos stops each output at a uniform random length up to its
max_tokens.

    python benchmarks/scripts/scheduler_sim.py --pool-tokens 1850000 [--reserve] [--eos]
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
        block_size=args.block_size, enable_prefix_caching=True, admission="reserve" if args.reserve else "on_demand",
    )  # fmt: skip
    s = Scheduler(config, args.pool_tokens // args.block_size + 1)
    rng = random.Random(0)
    stop_at = {}
    for i in range(args.prompts):  # distinct prompts: nothing shared but what a recompute finds cached
        prompt = [rng.randrange(1, 120_000) for _ in range(args.input)]
        stop_at[str(i)] = rng.randint(1, args.output) if args.eos else args.output
        params = SamplingParams(max_tokens=args.output, ignore_eos=True)
        s.add(Request(str(i), prompt, params, 0, RequestMetrics(0.0), max_tokens=args.output))
    steps = computed = decode_rows = 0
    rows: list[int] = []
    estimate_ms = 0.0
    while s.waiting or s.running:
        positions = sum(r.num_computed for r in s.running)  # what the step's attention reads, about
        out = s.schedule()
        steps += 1
        known = {r.request_id: r for r in s.running}
        singles = sum(1 for p in out.seqs if p.num_tokens == 1)
        rows.append(singles)
        decode_rows += singles
        gemms_ms = max(args.weights_ms, 1e-3 * args.token_us * out.num_tokens)  # weight-bound or compute-bound
        estimate_ms += gemms_ms + 1e-6 * args.position_ns * positions
        for piece in out.seqs:
            computed += piece.num_tokens
            request = known[piece.request_id]
            s.computed(request, piece)
            if piece.samples:
                request.num_pending -= 1
                request.token_ids.append(7)
                if len(request.output_token_ids) >= stop_at[request.request_id]:
                    s.finish(request, "length")
        if steps > 100 * (args.input + args.output):
            raise RuntimeError("the load does not drain")
    needed = sum(args.input + n - 1 for n in stop_at.values())
    return {
        "steps": steps,
        "preemptions": s.preemptions,
        "tokens computed": computed,
        "of them again (preemption)": computed - needed,
        "share computed again": (computed - needed) / needed,
        "decode rows a step (mean over steps with any)": statistics.fmean(r for r in rows if r) if decode_rows else 0,
        "steps with 1000+ decode rows": sum(r >= 1000 for r in rows),
        "prefix hits (tokens)": s.blocks.stats.hit_tokens,
        "estimated s (the step-time model)": estimate_ms / 1e3,
        "estimated output tok/s": sum(stop_at.values()) / (estimate_ms / 1e3),
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
    parser.add_argument("--reserve", action="store_true", help="admit only what the pool holds to the end")
    parser.add_argument("--eos", action="store_true", help="each output stops at a random length")
    parser.add_argument("--weights-ms", type=float, default=2.9, help="a step's weight read (8B FP8, H100)")
    parser.add_argument("--token-us", type=float, default=18.0, help="a token's GEMMs where compute-bound")
    parser.add_argument("--position-ns", type=float, default=28.9, help="a cached position's FP8 K/V read")
    for name, value in simulate(parser.parse_args()).items():
        print(f"{name}: {value:,.3f}" if isinstance(value, float) else f"{name}: {value:,}")


if __name__ == "__main__":
    main()
