"""`fp8route quantize SRC DST --format ...`: a static per-tensor FP8 checkpoint from a bf16/fp16 one."""

from __future__ import annotations

import argparse

from fp8route.checkpoint.formats import FORMATS
from fp8route.checkpoint.quantize import quantize_checkpoint
from fp8route.progress import TextProgress


def run(args: argparse.Namespace) -> int:
    exclude = list(args.exclude or [])
    if not args.quantize_lm_head and "lm_head" not in exclude:
        exclude.append("lm_head")
    result = quantize_checkpoint(
        args.src,
        args.dst,
        format=args.format,
        calib=args.calib,
        exclude=exclude,
        device=args.device,
        max_shard_bytes=int(args.max_shard_gb * 2**30),
        progress=None if args.quiet else TextProgress("quantize"),
    )
    calib = args.calib or "generated token ids"
    print(
        f"wrote {result.dst} ({result.format}): {len(result.quantized)} FP8 linears, "
        f"{len(result.excluded)} excluded ({', '.join(result.excluded) or 'none'}), {len(result.shards)} shard(s), "
        f"calibrated on {result.calibration_tokens} tokens of {calib}, {result.seconds:.1f}s"
    )
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "quantize", help="make a per-tensor FP8 checkpoint (ModelOpt or compressed-tensors) from a bf16/fp16 one"
    )
    parser.add_argument("src", help="bf16/fp16 Hugging Face checkpoint folder (Llama-family)")
    parser.add_argument("dst", help="new folder to write")
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument(
        "--calib", help="token ids to calibrate input scales on (.json, .txt or .safetensors); default: generated ones"
    )
    parser.add_argument(
        "--exclude",
        action="append",
        metavar="PATTERN",
        help="module name or fnmatch wildcard to leave unquantized (repeatable)",
    )
    parser.add_argument("--quantize-lm-head", action="store_true", help="quantize lm_head too (excluded by default)")
    parser.add_argument("--device", help="where calibration runs: cuda or cpu (default: cuda when available)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="largest shard to write, in GiB")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)
