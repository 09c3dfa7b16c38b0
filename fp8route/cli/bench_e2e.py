"""`fp8route bench e2e`: TTFT, prefill and decode speed of a whole model per policy arm, in one run."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import torch

from fp8route.backends import BACKENDS
from fp8route.bench.e2e import (
    START,
    ArmOptions,
    E2ERow,
    as_json,
    bench_arm,
    options_summary,
    plot,
    scheme_summary,
    split_table,
    table,
    tp_summary,
)
from fp8route.checkpoint.random import write_random
from fp8route.cli.sweep_args import command_line, cuda_device, int_list
from fp8route.engine.config import Flag, add_engine_args, sweep_values
from fp8route.engine.flashinfer_attention import check_attention
from fp8route.errors import Fp8InputError
from fp8route.kernels.options import why_not_pdl
from fp8route.models.shapes import MODELS
from fp8route.models.spawn import run_ranks
from fp8route.routing.fingerprint import Fingerprint
from fp8route.schemes import SCHEMES, Scheme, check_scheme
from fp8route.tuning.timing import copy_bandwidth_gbs

# deterministic: routed with the engine in its deterministic mode (EngineConfig.deterministic).
ARMS = ("routed", "deterministic", "bf16", *BACKENDS)
PDL_ARMS = {"auto": None, "on": True, "off": False}
PDL_HELP = (
    "programmatic dependent launch of fp8route's kernels: auto (the engine's default: each decode graph captured "
    "with and without it, the faster kept), on, off (every launch), or several comma-separated (each an arm)"
)


@dataclass(frozen=True)
class _Run:
    """One arm of a round: the policy arm on one checkpoint, how it runs, at one tensor parallel size."""

    tp: int
    arm: str
    attention: str
    kv_cache_dtype: str
    options: ArmOptions
    checkpoint: str  # a key of the folders: a scheme's FP8 checkpoint, or "bf16"
    all_reduce: str


@dataclass(frozen=True)
class _Plan:
    """The arms and shapes a run times, from the command line, checked."""

    arms: list[str]
    batches: list[int]
    inputs: list[int]
    sizes: list[int]  # tensor parallel sizes
    methods: list[str]  # all-reduce methods, for tp > 1
    attentions: list[str]
    kv_dtypes: list[str]  # EngineConfig.kv_cache_dtype
    options: list[ArmOptions]
    schemes: list[Scheme]  # of the random checkpoints (one each); a given checkpoint's is its own


def run(args: argparse.Namespace) -> int:
    device = cuda_device(argparse.Namespace(device="cuda"))
    plan = _plan(args, device)
    fingerprint = Fingerprint.of(device)
    print(f"bench e2e on {fingerprint.summary()}")
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth (this run): {copy_gbs:.0f} GB/s")
    with tempfile.TemporaryDirectory(prefix="fp8route-e2e-", dir=args.tmp) as tmp:
        rows = _bench(plan, _folders(args, plan, Path(tmp)), args.output, copy_gbs, args.rounds)
    print("\n" + table(rows))
    print("\n" + split_table(rows))
    if len(plan.sizes) > 1:
        print("\n" + tp_summary(rows))
    if len(plan.options) > 1:
        print("\n" + options_summary(rows))
    if len(plan.schemes) > 1:
        print("\n" + scheme_summary(rows))
    _write(args, rows, fingerprint, copy_gbs)
    return 0


def _plan(args: argparse.Namespace, device: torch.device) -> _Plan:
    arms = [a.strip() for a in args.policy.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise Fp8InputError(f"--policy: unknown {', '.join(unknown)}; known: {', '.join(ARMS)}")
    if (args.model is None) == (args.random is None):
        raise Fp8InputError("give MODEL (a checkpoint folder) or --random NAME, one of them")
    if args.random is not None and args.random not in MODELS:
        raise Fp8InputError(f"--random: unknown model {args.random!r}; known: {', '.join(MODELS)}")
    if args.model is not None and "bf16" in arms:
        raise Fp8InputError("the bf16 arm needs the same weights unquantized: use --random, or leave bf16 out")
    batches, inputs = int_list(args.batch, "--batch"), int_list(args.input, "--input")
    sizes, methods = sweep_values(args, "tp"), sweep_values(args, "all_reduce")
    if max(sizes) > torch.cuda.device_count():
        raise Fp8InputError(f"--tp {max(sizes)} needs that many GPUs; {torch.cuda.device_count()} are visible")
    if args.rounds < 1:
        raise Fp8InputError(f"--rounds must be at least 1, got {args.rounds}")
    if args.output < 2:
        raise Fp8InputError(f"--output must be at least 2 (a decode step is timed), got {args.output}")
    attentions = sweep_values(args, "attention")
    for attention in attentions:
        check_attention(attention, device)
    pdls = _pdl_arms(args.pdl)
    if True in pdls and (reason := why_not_pdl(device)) is not None:
        raise Fp8InputError(f"--pdl on: programmatic dependent launch: {reason}")
    options = [ArmOptions(p, q) for p in pdls for q in sweep_values(args, "quantize_upstream")]
    schemes = [check_scheme(s.strip()) for s in args.scheme.split(",") if s.strip()]
    if args.model is not None and args.scheme != "tensor":
        raise Fp8InputError("--scheme is for --random checkpoints; a checkpoint folder's scheme is its own")
    kv_dtypes = sweep_values(args, "kv_cache_dtype")
    return _Plan(arms, batches, inputs, sizes, methods, attentions, kv_dtypes, options, list(dict.fromkeys(schemes)))


def _pdl_arms(text: str) -> list[bool | None]:
    """--pdl's arms: None for auto (the engine's measured choice), True for on, False for off."""
    words = [w for w in re.split(r"[,\s]+", text) if w]
    if not words or any(w not in PDL_ARMS for w in words):
        raise Fp8InputError(f"--pdl: {', '.join(PDL_ARMS)}, or several comma-separated, got {text!r}")
    return list(dict.fromkeys(PDL_ARMS[w] for w in words))


def _folders(args: argparse.Namespace, plan: _Plan, tmp: Path) -> dict[str, Path]:
    """The checkpoints the arms load: one FP8 folder per scheme, "bf16" for the bf16 arm (random
    checkpoints only; the same weights in every one)."""
    if args.random is None:
        return {"fp8": Path(args.model)}
    config = MODELS[args.random]
    folders: dict[str, Path] = {s: write_random(tmp / f"fp8-{s}", config, fp8=True, scheme=s) for s in plan.schemes}
    if "bf16" in plan.arms:
        folders["bf16"] = write_random(tmp / "bf16", config, fp8=False)
    print(f"random checkpoints of {args.random} ({', '.join(folders)}) written to {tmp}")
    return folders


def _bench(plan: _Plan, folders: dict[str, Path], output: int, copy_gbs: float, rounds: int) -> list[E2ERow]:
    """Every arm on every checkpoint at every tensor parallel size (and all-reduce method), `rounds`
    times, printing each arm's rows as they come."""
    rows: list[E2ERow] = []
    fp8 = [name for name in folders if name != "bf16"]
    runs = [
        _Run(tp, arm, attention, kv, option, checkpoint, method)
        for tp in plan.sizes
        for arm, attention, kv, option in itertools.product(plan.arms, plan.attentions, plan.kv_dtypes, plan.options)
        for checkpoint in (["bf16"] if arm == "bf16" else fp8)
        for method in (plan.methods if tp > 1 else ["nccl"])
    ]
    for round_, order in enumerate(round_orders(runs, rounds)):
        for run in order:
            run_args = (run.arm, folders[run.checkpoint], plan.batches, plan.inputs, output, copy_gbs)
            bench = functools.partial(
                bench_arm, tp=run.tp, all_reduce=run.all_reduce, attention=run.attention,
                kv_cache_dtype=run.kv_cache_dtype, options=run.options,
            )  # fmt: skip
            timed = bench(*run_args) if run.tp == 1 else run_ranks(run.tp, bench, *run_args)
            new = [replace(r, round=round_) for r in timed]
            rows += new
            print(table(new).split("\n", 1)[1], flush=True)
    return rows


T = TypeVar("T")


def round_orders(runs: list[T], rounds: int) -> list[list[T]]:
    """The runs of each round: in order, then reversed, and so on, so that no arm's place in the run
    weighs on a ratio taken within rounds (benchmarks/results/h100/serve_bound/ saw it weigh)."""
    return [runs if r % 2 == 0 else runs[::-1] for r in range(rounds)]


def _write(args: argparse.Namespace, rows: list[E2ERow], fingerprint: Fingerprint, copy_gbs: float) -> None:
    """The rows as JSON (with the command and the device) and as a PNG, under --out."""
    out = Path(args.out).expanduser() if args.out else Path("bench-results") / fingerprint.slug
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": command_line(),
        "fingerprint": fingerprint.to_json(),
        "torch": torch.__version__,
        "copy_gbs": round(copy_gbs, 1),
        "rows": as_json(rows),
    }
    stem = f"e2e-{args.random or Path(args.model).name}"
    path = out / f"{stem}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    png = plot(rows, out / f"{stem}.png", f"{args.random or args.model} on {fingerprint.gpu}")
    if png is not None:
        print(f"wrote {png}")


def register(kinds: argparse._SubParsersAction) -> None:
    e2e = kinds.add_parser("e2e", help="TTFT, prefill and decode of a whole model per policy arm (GPU)")
    add_engine_args(e2e, ["model"], model=Flag(help="an FP8 checkpoint folder (or give --random)", optional=True))
    e2e.add_argument(
        "--random",
        metavar="NAME",
        help=f"write and run a random checkpoint of {' | '.join(MODELS)} (default: none: give MODEL)",
    )
    e2e.add_argument(
        "--scheme",
        default="tensor",
        help=f"FP8 schemes of the --random checkpoints, one checkpoint each, comma-separated: {', '.join(SCHEMES)} "
        "(default tensor)",
    )
    e2e.add_argument("--batch", default="1,16", help="rows decoded together, comma-separated batch sizes")
    e2e.add_argument("--input", default="1024,4096", help="prompt tokens per row")
    e2e.add_argument("--output", type=int, default=128, help="new tokens per row")
    e2e.add_argument(
        "--rounds", type=int, default=1,
        help="run the arms this many times, every other time in reverse order (each summary compares within a "
        "round, so an arm's place in the run weighs on no ratio)",
    )  # fmt: skip
    e2e.add_argument("--policy", default="routed,cublas,rowwise,bf16", help=f"arms: {', '.join(ARMS)}")
    add_engine_args(
        e2e, ["attention", "kv_cache_dtype", "pdl", "quantize_upstream", "tp", "all_reduce"], sweep=True,
        # an arm names a value: as a process starts
        pdl=Flag(default="auto", help=PDL_HELP), quantize_upstream=Flag(default=START.quantize_upstream),
    )  # fmt: skip
    e2e.add_argument("--tmp", help="where the random checkpoints are written (default: the system's temp)")
    e2e.add_argument("--out", help="directory for the JSON (default: ./bench-results/<device>/)")
    e2e.set_defaults(run=run)
