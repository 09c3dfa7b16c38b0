"""`fp8route bench decode`: fp8_gemv's decode kernels against cuBLASLt and CUTLASS at M <= 128."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp8route.cli.sweep_args import command_line, cuda_device, int_list

DEFAULT_MS = "1,2,4,8,16,32,64,128"
DEFAULT_SWEEP_MS = "1,2,4,8,16"


def spec_from_args(args: argparse.Namespace):  # -> DecodeBenchSpec
    from fp8route.bench.decode import CUDA_CORE_BLOCKS, SHAPES, DecodeBenchSpec, check_spec, parse_blocks

    spec = DecodeBenchSpec(
        shapes=tuple(SHAPES) if args.shapes == "all" else tuple(s.strip() for s in args.shapes.split(",") if s.strip()),
        ms=tuple(int_list(args.ms, "--ms")),
        repeats=args.repeats,
        graph=args.graph,
        graph_replays=args.graph_replays,
        sweep_ms=tuple(int_list(args.sweep_ms, "--sweep-ms")) if args.sweep else (),
        sweep_kinds=args.sweep_kinds,
        sweep_repeats=args.sweep_repeats,
        sweep_block_ms=()
        if args.sweep_block_ms == "none"
        else tuple(int_list(args.sweep_block_ms, "--sweep-block-ms")),
        cuda_core_blocks=CUDA_CORE_BLOCKS
        if args.cuda_core_blocks == "built-in"
        else parse_blocks(args.cuda_core_blocks),
    )
    check_spec(spec)
    return spec


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    cuda_device(argparse.Namespace(device="cuda"))
    from fp8route.bench.decode import run as run_bench
    from fp8route.bench.decode_report import plot, summarize

    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    result = run_bench(spec, out, command_line()).__dict__
    try:
        plot(result, out / "decode_bench.png")
    except ImportError as exc:  # the numbers are in the JSON; the PNG needs the plot extra
        print(f"no plot ({exc}): pip install 'fp8route[plot]'")
    print(summarize(result))
    print(f"wrote {out / 'decode_bench.json'}")
    return 0


def register(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "decode",
        help="fp8_gemv's decode kernels against cuBLASLt and CUTLASS at M <= 128, per call and in a graph; "
        "--sweep times its configurations (GPU)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", default="bench-results/decode", help="folder for decode_bench.json and .png")
    parser.add_argument("--shapes", default="all", help="comma-separated tp{1,2,4}_{qkv,o,gate_up,down}, or all")
    parser.add_argument("--ms", default=DEFAULT_MS, help="M values, comma-separated (each <= 128)")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per rep")
    parser.add_argument("--graph", action="store_true", help="also time every arm inside a CUDA graph")
    parser.add_argument("--graph-replays", type=int, default=10, help="graph replays per rep")
    parser.add_argument("--sweep", action="store_true", help="also time every candidate configuration of ours")
    parser.add_argument("--sweep-ms", default=DEFAULT_SWEEP_MS, help="M values to sweep configurations at")
    parser.add_argument("--sweep-kinds", default="wgmma", help="kernels to sweep: wgmma, cuda_core or both (comma)")
    parser.add_argument("--sweep-repeats", type=int, default=20, help="timed calls per swept configuration")
    parser.add_argument("--sweep-block-ms", default="none", help="wgmma token tiles to sweep below M's own, e.g. 16,32")
    parser.add_argument(
        "--cuda-core-blocks", default="built-in",
        help="CUDA-core blocks to sweep, BLOCK_NxBLOCK_KxWARPSxSTAGES[xMAXNREG],... or built-in",
    )  # fmt: skip
    parser.set_defaults(run=run)
