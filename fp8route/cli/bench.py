"""`fp8route bench gemm`: routed vs every single-backend policy, per shape and M, with floors."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fp8route.backends import BACKENDS
from fp8route.cli import bench_attention, bench_decode, bench_e2e, bench_figures, bench_idle, bench_serve
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
from fp8route.errors import Fp8InputError, Fp8RouteError
from fp8route.progress import TextProgress
from fp8route.routing.fingerprint import Fingerprint
from fp8route.routing.store import load_table
from fp8route.schemes import DESCRIPTION
from fp8route.tuning.ceilings import measure_ceilings
from fp8route.tuning.gemm_bench import default_policies, make_report, sweep, write_results
from fp8route.tuning.report import ROUTED
from fp8route.tuning.timing import HostBehindError, batch_summary


def run_gemm(args: argparse.Namespace) -> int:
    try:
        device = cuda_device(args)
        shapes, label = shapes_from_args(args)
        m_values = m_values_from_args(args)
        info = DeviceInfo.of(device)
        policies = _policies(args.policy, info)
        timer = timer_from_args(args)
        dtype = dtype_from_args(args)
    except Fp8RouteError as exc:
        print(f"fp8route bench gemm: {exc}", file=sys.stderr)
        return 2
    fingerprint = Fingerprint.of(device)
    table = load_table(device, path=args.table)
    print(f"bench gemm on {fingerprint.summary()}; clock: {args.clock}")
    print(f"routing table: {table.origin if table else 'none (routed = default priority; run `fp8route tune` first)'}")
    if args.x_quantized:
        print("x arrives quantized (fused upstream): every arm times its GEMM alone")
    print(f"layers: {DESCRIPTION[args.scheme]}")
    start = time.perf_counter()
    try:
        ceilings = measure_ceilings(device, clock=args.clock)
        print(f"ceilings (this run): copy {ceilings.copy_gbs:.0f} GB/s, FP8 GEMM {ceilings.fp8_tflops:.0f} TFLOP/s\n")
        cells = sweep(
            shapes,
            m_values,
            policies,
            table=table,
            device=device,
            dtype=dtype,
            repeats=args.repeats,
            progress=TextProgress("bench"),
            x_quantized=args.x_quantized,
            timer=timer,
            scheme=args.scheme,
        )
    except HostBehindError as exc:
        print(f"fp8route bench gemm: {exc}; nothing was written", file=sys.stderr)
        return 2
    report = make_report(cells, shapes, m_values, ceilings, dtype)
    print(report.text())
    print(batch_summary())
    out_dir = Path(args.out).expanduser() if args.out else Path("bench-results") / fingerprint.slug
    meta = {
        "command": command_line(),
        "model": args.model or args.shapes,
        "tp": args.tp,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "x_quantized": args.x_quantized,
        "scheme": args.scheme,
        "clock": args.clock,
        "seconds": round(time.perf_counter() - start, 1),
    }
    stem = (
        f"gemm-{label}" + ("-xq" if args.x_quantized else "") + ("" if args.scheme == "tensor" else f"-{args.scheme}")
    )
    for path in write_results(report, out_dir, stem, fingerprint=fingerprint, table=table, meta=meta):
        print(f"wrote {path}")
    return 0


def _policies(text: str | None, device: DeviceInfo) -> list[str]:
    if not text:
        return default_policies(device)
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p != ROUTED and p not in BACKENDS]
    if unknown:
        raise Fp8InputError(f"--policy: unknown {', '.join(unknown)}; known: {ROUTED}, {', '.join(BACKENDS)}")
    # routed is always measured: every speedup is relative to it.
    return [ROUTED, *(p for p in dict.fromkeys(names) if p != ROUTED)]


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "bench",
        help="benchmarks: gemm (routed vs every single GEMM backend), e2e (a whole model per arm), "
        "serve (a serving load, in-process or over HTTP), decode (the decode GEMM kernels), attention (the paged "
        "attention kernel), idle (the GPU's idle time between engine steps), figures (README's table)",
    )
    kinds = parser.add_subparsers(dest="bench", required=True)
    gemm = kinds.add_parser(
        "gemm", help="time routed and each single-backend policy per shape and M, with floors; JSON + PNG"
    )
    add_sweep_args(gemm)
    gemm.add_argument(
        "--policy",
        help=f"comma-separated: {ROUTED}, {', '.join(BACKENDS)} (default: routed and every backend but last resorts)",
    )
    gemm.add_argument("--table", help="routing table for routed (default: this machine's, see `fp8route tune`)")
    gemm.add_argument(
        "--x-quantized",
        action="store_true",
        help="hand every arm x already quantized (the quantization fused upstream, as Fp8Linear.forward_quantized "
        "takes it): GEMMs alone",
    )
    gemm.add_argument("--out", help="directory for the JSON and PNGs (default: ./bench-results/<device>/)")
    gemm.set_defaults(run=run_gemm)
    bench_e2e.register(kinds)
    bench_serve.register(kinds)
    bench_decode.register(kinds)
    bench_attention.register(kinds)
    bench_idle.register(kinds)
    bench_figures.register(kinds)
