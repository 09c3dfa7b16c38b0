"""Arguments shared by `fp8route tune` and `fp8route bench gemm`: which shapes, which M, which device."""

from __future__ import annotations

import argparse
import functools
import re
import shlex
import sys
from pathlib import Path

import torch

from fp8route.engine.config import Flag, add_engine_args, sweep_values
from fp8route.errors import Fp8InputError
from fp8route.linear.plan import M_BOUNDS
from fp8route.models.shapes import MODELS, LayerShape, model_shapes, parse_shapes, unique_shapes
from fp8route.schemes import SCHEMES
from fp8route.tuning.cupti import cupti_available
from fp8route.tuning.timing import CLOCKS, time_arms
from fp8route.tuning.workload import TimeArms

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # the activations the GEMM backends take


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    model = f"{' | '.join(MODELS)} | PATH (config.json or its folder) (default: none: give it or --shapes)"
    add_engine_args(parser, ["model"], model=Flag(None, model, spelling="--model"))
    add_engine_args(parser, ["tp"], sweep=True, tp=Flag(help="tensor-parallel size, or several: 1,4 (default 1)"))
    parser.add_argument(
        "--shapes",
        help="explicit NxK shapes instead of (or besides) --model, e.g. 6144x4096,4096x14336 (default: none)",
    )
    parser.add_argument("--m", help="M values, e.g. 1,16,128 (default: the plan's buckets 1, 2, 4 ... 16384)")
    add_engine_args(parser, ["dtype"], dtype=Flag(help="activation and output dtype", choices=sorted(DTYPES)))
    parser.add_argument(
        "--scheme",
        choices=SCHEMES,
        default="tensor",
        help="the FP8 scheme of the layers: tensor (static per-tensor scales), channel (per-channel weights, "
        "per-token x) or block (128x128 weight blocks, 1x128 x groups) (default tensor)",
    )
    add_engine_args(parser, ["device"], device=Flag("cuda", "CUDA device (default: the current one)"))
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per arm and rep (default 30)")
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default="events",
        help="how a call is timed: events (CUDA events around it, the default) or cupti (its kernels' own "
        "durations as CUPTI records them, through torch.profiler)",
    )


def dtype_from_args(args: argparse.Namespace) -> torch.dtype:
    """--dtype, one the GEMM backends take."""
    if args.dtype not in DTYPES:
        raise Fp8InputError(f"--dtype must be one of {', '.join(sorted(DTYPES))}, got {args.dtype!r}")
    return DTYPES[args.dtype]


def timer_from_args(args: argparse.Namespace) -> TimeArms | None:
    """The arms' timer for --clock (None: the default, CUDA events)."""
    if args.clock == "events":
        return None
    if not cupti_available():
        raise Fp8InputError("--clock cupti: torch.profiler cannot record CUDA kernels here (no CUPTI)")
    return functools.partial(time_arms, clock=args.clock)


def int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in re.split(r"[,\s]+", text.strip()) if v]
    except ValueError:
        raise Fp8InputError(f"{what}: expected integers separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise Fp8InputError(f"{what}: expected positive integers, got {text!r}")
    return values


def shapes_from_args(args: argparse.Namespace) -> tuple[list[LayerShape], str]:
    """The shapes to sweep and a file-name-safe label for them."""
    if not args.model and not args.shapes:
        raise Fp8InputError("give --model (llama-3.1-8b, llama-3.1-70b or a config.json) or --shapes NxK,...")
    shapes: list[LayerShape] = []
    label = ""
    tps = sweep_values(args, "tp")
    if args.model:
        for tp in tps:
            # The same shape can recur across tp sizes; each keeps its first name.
            shapes += [
                LayerShape(s.name if len(tps) == 1 else f"{s.name}@tp{tp}", s.n, s.k)
                for s in model_shapes(args.model, tp)
            ]
        name = args.model if args.model.lower() in MODELS else Path(args.model).expanduser().resolve().name
        label = f"{re.sub(r'[^A-Za-z0-9.]+', '-', name).strip('-').lower()}-tp{'-'.join(map(str, tps))}"
    if args.shapes:
        shapes += parse_shapes(args.shapes)
        label = label or "shapes"
    return unique_shapes(shapes), label


def m_values_from_args(args: argparse.Namespace) -> list[int]:
    return sorted(set(int_list(args.m, "--m"))) if args.m else list(M_BOUNDS)


def cuda_device(args: argparse.Namespace) -> torch.device:
    if not torch.cuda.is_available():
        raise Fp8InputError("this command measures GPU kernels and needs a CUDA GPU; none is visible to torch")
    device = torch.device(args.device)
    if device.type != "cuda":
        raise Fp8InputError(f"--device must be a CUDA device, got {args.device!r}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


def command_line() -> str:
    return "fp8route " + shlex.join(sys.argv[1:])
