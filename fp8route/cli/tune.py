"""`fp8route tune`: measure every eligible backend for a model's shapes on this GPU and save the
routing table that Fp8Linear layers (through fp8route.route) then follow."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from fp8route.backends.problem import GemmProblem
from fp8route.cli.sweep_args import (
    add_sweep_args,
    command_line,
    cuda_device,
    dtype_from_args,
    m_values_from_args,
    shapes_from_args,
    timer_from_args,
)
from fp8route.device import DeviceInfo
from fp8route.errors import Fp8RouteError
from fp8route.linear.plan import make_plan
from fp8route.linear.policy import Policy
from fp8route.models.shapes import LayerShape
from fp8route.progress import TextProgress
from fp8route.routing.choose import MIN_TIE
from fp8route.routing.fingerprint import Fingerprint
from fp8route.routing.store import default_path, display_path, save_table
from fp8route.routing.table import RoutingTable
from fp8route.schemes import DESCRIPTION
from fp8route.tuning.timing import HostBehindError, batch_summary
from fp8route.tuning.tuner import Tuner
from fp8route.tuning.workload import CudaMeasure


def run_tune(args: argparse.Namespace) -> int:
    try:
        _use_local_rank(args)
        device = cuda_device(args)
        shapes, _ = shapes_from_args(args)
        m_values = m_values_from_args(args)
        backends = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None
        rank = _init_distributed()
        info, fingerprint = DeviceInfo.of(device), Fingerprint.of(device)
        dtype = dtype_from_args(args)
        measure = CudaMeasure(device, repeats=args.repeats, timer=timer_from_args(args))
        tuner = Tuner(
            measure,
            info,
            fingerprint,
            m_values=m_values,
            dtypes=(dtype,),
            backends=backends,
            min_tie=args.min_tie,
            progress=TextProgress("tune") if rank == 0 else None,
            command=command_line(),
            x_quantized=args.x_quantized,
            scheme=args.scheme,
        )
    except Fp8RouteError as exc:
        print(f"fp8route tune: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        what = "x handed over quantized (GEMMs alone)" if args.x_quantized else "x quantized by each layer"
        print(
            f"tuning {len(shapes)} shapes x {len(m_values)} M values, {DESCRIPTION[args.scheme]}, {what}, "
            f"clock: {args.clock}, on {fingerprint.summary()}"
        )
    try:
        table, warm, elapsed = _tune(tuner, measure, shapes)
    except HostBehindError as exc:
        print(f"fp8route tune: {exc}; nothing was saved", file=sys.stderr)
        return 2
    if rank != 0:
        return 0
    print(f"tuned in {elapsed:.1f} s (+ {warm:.1f} s warm-up: JIT builds, first-call setup); {batch_summary()}\n")
    print(summary(table, info, dtype, args.x_quantized, args.scheme))
    _save(args, table, fingerprint)
    return 0


def _tune(tuner: Tuner, measure: CudaMeasure, shapes: list[LayerShape]) -> tuple[RoutingTable, float, float]:
    """The routing table, with the seconds of its warm-up and of the tuning; the measure released after.
    First calls build JIT kernels and library handles: done before the clock, reported apart."""
    dtype, m = tuner.dtypes[0], tuner.m_values[0]
    start = time.perf_counter()
    first = GemmProblem(
        shapes[0].n, shapes[0].k, tuner.device, out_dtype=dtype, static_input_scale=tuner.scheme == "tensor",
        scheme=tuner.scheme, x_quantized=tuner.x_quantized,
    ).with_bucket(dtype, m)  # fmt: skip
    try:
        measure(first, m, tuner.candidates(first))
        warm = time.perf_counter() - start
        start = time.perf_counter()
        table = tuner.tune(shapes)
    finally:
        measure.release()
    return table, warm, time.perf_counter() - start


def _save(args: argparse.Namespace, table: RoutingTable, fingerprint: Fingerprint) -> None:
    """Merge the table into --table (or this GPU's default file), and write a copy under --out if given."""
    path = Path(args.table).expanduser() if args.table else default_path(fingerprint)
    saved = save_table(table, path)
    print(f"\nrouting table: {display_path(path)} ({len(saved.shapes)} shapes); fp8route.route(model) uses it here")
    if args.out:
        copy = Path(args.out).expanduser() / f"routing-{fingerprint.slug}.json"
        save_table(saved, copy, merge=False)
        print(f"copy: {copy} (ship it as fp8route/routing/defaults/{fingerprint.slug}.json)")


def summary(
    table: RoutingTable, device: DeviceInfo, dtype: torch.dtype, x_quantized: bool = False, scheme: str = "tensor"
) -> str:
    """What each tuned shape will run, per M range, and every backend that failed somewhere."""
    lines = []
    for shape in sorted(table.shapes.values(), key=lambda s: (s.n, s.k)):
        if shape.dtype != dtype or shape.x_quantized != x_quantized or shape.scheme != scheme:
            continue
        problem = GemmProblem(
            shape.n,
            shape.k,
            device,
            out_dtype=dtype,
            static_input_scale=scheme == "tensor",
            scheme=scheme,  # type: ignore[arg-type]
        )
        plan = make_plan(f"{shape.n}x{shape.k}", problem, Policy(), table)
        lines.append(f"{shape.n:>6}x{shape.k:<6} {plan.route_text(dtype, x_quantized)}")
        lines += [f"{'':>14}{name} failed: {why}" for name, why in shape.failures.items()]
    return "\n".join(lines)


def _use_local_rank(args: argparse.Namespace) -> None:
    # Under torchrun every rank sees all GPUs; each tunes its own.
    if args.device == "cuda" and "LOCAL_RANK" in os.environ:
        args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"


def _init_distributed() -> int:
    """Join the process group torchrun describes (if any), so the tuner's ranks agree."""
    import torch.distributed as dist

    if not dist.is_available():
        return 0
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl")
    return dist.get_rank() if dist.is_initialized() else 0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "tune", help="time every eligible GEMM backend for a model's shapes on this GPU and save the routing table"
    )
    add_sweep_args(parser)
    parser.add_argument(
        "--backends", help="comma-separated backends to time (default: every eligible one but the last resorts)"
    )
    parser.add_argument(
        "--min-tie", type=float, default=MIN_TIE, help=f"gaps below this fraction are ties (default {MIN_TIE})"
    )
    parser.add_argument(
        "--table", help="table file to merge into (default: $FP8ROUTE_TABLE or the user cache file for this GPU)"
    )
    parser.add_argument("--out", help="also write a copy of the table into this directory (default: none)")
    parser.add_argument(
        "--x-quantized",
        action="store_true",
        help="tune for x handed over quantized (Fp8Linear.forward_quantized): GEMMs alone; these routes "
        "are kept beside the float-input ones",
    )
    parser.set_defaults(run=run_tune)
