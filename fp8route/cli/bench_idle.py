"""`fp8route bench idle`: the engine's host time per step and the GPU's idle time between steps."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp8route.cli.sweep_args import cuda_device, int_list
from fp8route.engine.config import Flag, add_engine_args
from fp8route.errors import Fp8InputError

IDLE_SAMPLINGS = ("greedy", "mixed")  # bench serve's arms that need no tokenizer


def run(args: argparse.Namespace) -> int:
    batches = int_list(args.batches, "--batches")
    samplings = args.sampling.split(",")
    unknown = [s for s in samplings if s not in IDLE_SAMPLINGS]
    if unknown:
        raise Fp8InputError(f"--sampling takes {', '.join(IDLE_SAMPLINGS)} (comma-separated), got {unknown[0]!r}")
    if args.steps < 1:
        raise Fp8InputError(f"--steps must be at least 1, got {args.steps}")
    device = cuda_device(argparse.Namespace(device="cuda"))
    from fp8route.bench.idle import MIXED_ARRIVALS, holders_text, measure, table
    from fp8route.engine.llm import LLM
    from fp8route.routing.fingerprint import Fingerprint

    print(f"bench idle on {Fingerprint.of(device).summary()}")
    rows_needed = max(batches) + MIXED_ARRIVALS  # the mixed stretch's arrivals beside the batch
    llm = LLM(args.path, max_num_seqs=rows_needed, max_model_len=args.max_model_len, skip_tokenizer_init=True,
              record_stats=True, deterministic=args.deterministic)  # fmt: skip
    rows = []
    for sampling in samplings:
        for batch in batches:
            for kind, arrivals in (("decode", 0), ("mixed", MIXED_ARRIVALS)):
                row = measure(llm, batch, args.steps, arrivals, sampling, args.host_profile)
                rows.append(row | {"kind": kind, "sampling": sampling})
    print(table(rows))
    for row in rows if args.host_profile else ():
        print(holders_text(row))
    return 0


def register(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "idle",
        help="the GPU's idle share between engine steps and the host time per step, decode-only and mixed (GPU)",
    )
    parser.add_argument("path", help="checkpoint folder (e.g. a random one: fp8route.checkpoint.random.write_random)")
    parser.add_argument("--batches", default="64,256", help="decoding requests per measurement, comma-separated")
    parser.add_argument("--steps", type=int, default=40, help="engine steps profiled per measurement")
    parser.add_argument(
        "--sampling",
        default="greedy",
        help=f"what each request asks for, comma-separated: {', '.join(IDLE_SAMPLINGS)} (bench serve's arms)",
    )
    parser.add_argument(
        "--host-profile",
        type=Path,
        default=None,
        help="also profile the host's side of each measurement (torch ops and CUDA runtime calls): write its "
        "Chrome trace into this folder and print what the host spent each step on (default: off)",
    )
    add_engine_args(parser, ["max_model_len", "deterministic"], max_model_len=Flag(default=8192))
    parser.set_defaults(run=run)
