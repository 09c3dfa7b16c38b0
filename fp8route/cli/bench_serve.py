"""`fp8route bench serve`: a serving load on the engine, per arm (policy, prefix caching), each in
its own process; the report SGLang's and vLLM's serving benchmarks give, as a table, JSON and PNG."""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from fp8route.backends import BACKENDS
from fp8route.bench.results import load_options, loads, write_results
from fp8route.bench.serve import SAMPLINGS, Arm, run_arm
from fp8route.bench.workload import LoadRequest, ServeReport, table_header, table_row
from fp8route.checkpoint.formats import CONFIG, read_json
from fp8route.checkpoint.random import write_random
from fp8route.cli import bench_serve_http
from fp8route.cli.sweep_args import command_line
from fp8route.device import default_device
from fp8route.engine.config import EngineConfig, Flag, add_engine_args, sweep_values
from fp8route.engine.load import eos_token_ids, resolve_model
from fp8route.errors import Fp8InputError
from fp8route.models.shapes import MODELS
from fp8route.routing.fingerprint import Fingerprint
from fp8route.schemes import SCHEMES, check_scheme

POLICIES = ("routed", "bf16", *BACKENDS)


# The settings bench serve can compare as arms (each flag takes a comma-separated list), and how an arm's
# name shows them when a list has more than one value.
AXES = {
    "enable_prefix_caching": ("--prefix-caching", "prefix"),
    "async_scheduling": ("--async-scheduling", "async"),
    "prefill_graphs": ("--prefill-graphs", "graphs"),
    "admission": ("--admission", "admission"),
}
ENGINE_ARGS = ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "max_model_len", "num_kv_blocks",
               "block_size", "attention", "use_cuda_graphs", "dtype", "itl_target_ms", "deterministic")  # fmt: skip


def _arms(args: argparse.Namespace, folders: dict[str, Path]) -> list[Arm]:
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise Fp8InputError(f"--policy: unknown {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    axes = {name: sweep_values(args, name, flag) for name, (flag, _) in AXES.items()}
    kv_dtypes = sweep_values(args, "kv_cache_dtype")
    samplings = [m.strip() for m in args.sampling.split(",") if m.strip()]
    if not samplings or any(m not in SAMPLINGS for m in samplings):
        raise Fp8InputError(f"--sampling: one or more of {', '.join(SAMPLINGS)}, got {args.sampling!r}")
    base = EngineConfig.from_args(
        args, kv_cache_dtype=kv_dtypes[0], **{axis: values[0] for axis, values in axes.items()}
    )
    arms = []
    fp8 = [name for name in folders if name != "bf16"]
    for policy, sampling in itertools.product(policies, samplings):
        for checkpoint, kv, *values in itertools.product(
            ["bf16"] if policy == "bf16" else fp8, kv_dtypes, *axes.values()
        ):
            settings = dict(zip(axes, values, strict=True))
            name = policy + (f" {checkpoint}" if len(fp8) > 1 and policy != "bf16" else "")
            name += (f" {sampling}" if len(samplings) > 1 else "") + (f" kv-{kv}" if len(kv_dtypes) > 1 else "")
            for axis, value in settings.items():
                shown = ("on" if value else "off") if isinstance(value, bool) else value
                name += f" {AXES[axis][1]}-{shown}" if len(axes[axis]) > 1 else ""
            folder = folders[checkpoint]
            config = base.replace(kv_cache_dtype=kv, **settings)
            arms.append(Arm(name, policy, folder, config, args.lone_prefill, args.static_batch, sampling))
    return arms


RunArm = Callable[[Arm, list[LoadRequest], list[LoadRequest]], tuple[ServeReport, list[str]]]


def _run_in_child(arm: Arm, load: list[LoadRequest], warmup: list[LoadRequest]) -> tuple[ServeReport, list[str]]:
    # A fresh process per arm: its GPU memory, routes and compiled kernels start clean, as bench e2e's do.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_arm, arm, load, warmup).result()


def _run_arms(
    arms: list[Arm], load: list[LoadRequest], warmup: list[LoadRequest], run_arm: RunArm | None = None
) -> tuple[list[ServeReport], dict[str, list[str]]]:
    """Each arm's report and token digests; its row of the table printed as it finishes, under the
    table's header printed once, before the first."""
    reports: list[ServeReport] = []
    digests: dict[str, list[str]] = {}
    for arm in arms:
        report, digest = (run_arm or _run_in_child)(arm, load, warmup)
        if not reports:
            print("\n" + table_header())
        reports.append(report)
        digests[arm.name] = digest
        print(table_row(report), flush=True)
    return reports, digests


def run(args: argparse.Namespace) -> int:
    if args.url is not None:
        return bench_serve_http.run(args)
    if (args.model is None) == (args.random is None):
        raise Fp8InputError("give MODEL (a checkpoint folder) or --random NAME, one of them")
    if args.random is not None and args.random not in MODELS:
        raise Fp8InputError(f"--random: unknown model {args.random!r}; known: {', '.join(MODELS)}")
    load_options(args)
    schemes = list(dict.fromkeys(check_scheme(s.strip()) for s in args.scheme.split(",") if s.strip()))
    if args.model is not None and args.scheme != "tensor":
        raise Fp8InputError("--scheme is for --random checkpoints; a checkpoint folder's scheme is its own")
    device = default_device().type
    fingerprint = Fingerprint.of(device)
    print(f"bench serve on {fingerprint.summary() if device == 'cuda' else 'cpu'}")
    with tempfile.TemporaryDirectory(prefix="fp8route-serve-", dir=args.tmp) as tmp:
        folders: dict[str, Path] = {}
        policies = args.policy.split(",")
        if args.random is not None:
            for scheme in schemes:
                folders[scheme] = write_random(
                    Path(tmp) / f"fp8-{scheme}", MODELS[args.random], fp8=True, scheme=scheme
                )
            if "bf16" in policies:
                folders["bf16"] = write_random(Path(tmp) / "bf16", MODELS[args.random], fp8=False)
            print(f"random checkpoints of {args.random} ({', '.join(folders)}) written to {tmp}")
        else:
            folders["fp8"] = folders["bf16"] = resolve_model(args.model)
        config = read_json(next(iter(folders.values())) / CONFIG)
        arms = _arms(args, folders)
        load, warmup = loads(args, int(config["vocab_size"]), eos_token_ids(config))
        reports, digests = _run_arms(arms, load, warmup)
    print("\n" + "\n".join(_checks(reports, digests, arms)))
    out = Path(args.out).expanduser() if args.out else Path("bench-results") / fingerprint.slug
    where = {"command": command_line(), "fingerprint": fingerprint.to_json() if device == "cuda" else {"device": "cpu"}}
    title = f"{args.random or args.model}: {args.num_prompts} requests"
    write_results(args, reports, out, f"serve-{args.random or Path(args.model).name}", title, where)
    return 0 if all(r.failed == 0 and not r.extra.get("leaked") for r in reports) else 1


# What a step may wait for that the warm-up should have taken out of the load.
_WAITS = {"kernel_first_launches": "kernels' first launches (compiles)", "alloc_retries": "allocator retries"}


def _checks(reports: list[ServeReport], digests: dict[str, list[str]], arms: list[Arm]) -> list[str]:
    """Nothing lost, nothing leaked, and the same greedy tokens with the prefix cache (or mixed
    steps) on and off."""
    lines = []
    for r in reports:
        leaked = r.extra.get("leaked")
        state = f"LEAKED: {leaked}" if leaked else "pool empty after the run"
        lines.append(f"{r.arm}: {r.completed} finished with their full output, {r.failed} failed; {state}")
        waits = [f"{r.extra[k]} {what}" for k, what in _WAITS.items() if r.extra.get(k)]
        if waits:
            kernels = sorted({str(name).split()[0] for name in r.extra.get("kernels_first_launched") or ()})
            named = f" ({', '.join(kernels)})" if kernels else ""
            lines.append(f"{r.arm}: steps under the load waited for {' and '.join(waits)}{named}")
        if "decode_step_ms" in r.extra:  # on a GPU: the pure decode steps against their floor
            e = r.extra
            lines.append(
                f"{r.arm}: {e['decode_steps']} decode steps, {e['decode_step_ms']:.2f} ms each at "
                f"{e['decode_batch_mean']:.0f} rows: {e['decode_gbs']:.0f} GB/s, {e['decode_over_floor']:.2f}x "
                f"their floor (weights + KV over {e['copy_gbs']:.0f} GB/s); "
                f"host {e['decode_host_ms_mean']:.2f} ms a step"
            )
            lines.append(
                f"{r.arm}: decode step p50 {e['decode_step_ms_p50']:.2f} / p90 {e['decode_step_ms_p90']:.2f} / max "
                f"{e['decode_step_ms_max']:.1f} ms; host p50 {e['decode_host_ms_p50']:.2f} / p90 "
                f"{e['decode_host_ms_p90']:.2f} / max {e['decode_host_ms_max']:.1f} ms"
            )
        if "gc_s" in r.extra:
            e = r.extra
            lines.append(
                f"{r.arm}: Python's garbage collector ran {e['gc_s']:.2f} s under the load, {e['gc_full_s']:.2f} s "
                f"of it in {e['gc_full']} full collections"
            )
        lines += _ratios(r)
        if "prefill_step_ms" in r.extra:
            e = r.extra
            lines.append(
                f"{r.arm}: {e['prefill_steps']} steps with prefill chunks, {e['prefill_step_ms']:.1f} ms each, "
                f"{e['prefill_tok_s_in_steps']:,.0f} prompt tok/s within them; "
                f"host {e['prefill_host_ms_mean']:.1f} ms a step"
            )
    # Arms that differ only in the prefix cache, async scheduling or prefill graphs should give the same
    # tokens (an fp8 KV cache's are compared with its own, not bf16's; a sampling's with its own). Admission
    # changes which requests share a step, and an FP8 model's tokens depend on that: not compared.
    labels = {"enable_prefix_caching": "the prefix cache", "async_scheduling": "async scheduling",
              "prefill_graphs": "prefill graphs"}  # fmt: skip
    for axis, label in labels.items():
        groups: dict[tuple[object, ...], list[Arm]] = {}
        for arm in arms:
            c = arm.config
            key = (arm.policy, arm.sampling, c.kv_cache_dtype, *(getattr(c, a) for a in AXES if a != axis))
            groups.setdefault(key, []).append(arm)
        for group in groups.values():
            if len(group) == 2:
                pairs = list(zip(digests[group[0].name], digests[group[1].name], strict=True))
                same = sum(a == b for a, b in pairs)
                verdict = "equal" if same == len(pairs) else f"DIFFER for {len(pairs) - same} of {len(pairs)} requests"
                lines.append(f"{group[0].name} / {group[1].name}: tokens with and without {label} {verdict}")
    return lines


def _ratios(r: ServeReport) -> list[str]:
    """The issue's must-show ratios, each against what the same arm measured apart: a request alone,
    a lone prefill, the static generate."""
    e, lines = r.extra, []
    if e.get("unloaded_ttft_ms") and e.get("unloaded_itl_ms"):
        ttft, itl = float(e["unloaded_ttft_ms"]), float(e["unloaded_itl_ms"])  # type: ignore[arg-type]
        lines.append(
            f"{r.arm}: TTFT p50 {r.ttft_ms['p50'] / ttft:.2f}x a request alone ({ttft:.1f} ms), "
            f"ITL p99 {r.itl_ms['p99'] / itl:.1f}x its step ({itl:.2f} ms)"
        )
    if e.get("lone_prefill_tok_s"):
        lone = float(e["lone_prefill_tok_s"])  # type: ignore[arg-type]
        lines.append(
            f"{r.arm}: input {r.input_throughput:,.0f} tok/s = {r.input_throughput / lone:.2f}x a lone "
            f"{e['lone_prefill_tokens']}-token prefill ({lone:,.0f} tok/s)"
        )
    if e.get("load_bound_output_tok_s"):
        bound = float(e["load_bound_output_tok_s"])  # type: ignore[arg-type]
        lines.append(
            f"{r.arm}: output {r.output_throughput:,.0f} tok/s = {r.output_throughput / bound:.2f} of the load's own "
            f"bound ({bound:,.0f} tok/s: prompts at the lone-prefill rate, then each output token's KV and the "
            f"weights once per step of {e['max_num_seqs']} rows at {e['copy_gbs']:,.0f} GB/s, or the output tokens "
            "at the lone-prefill rate where that is longer)"
        )
    if e.get("static_output_tok_s"):
        static = float(e["static_output_tok_s"])  # type: ignore[arg-type]
        lines.append(
            f"{r.arm}: output {r.output_throughput:,.0f} tok/s = {r.output_throughput / static:.2f}x the static "
            f"generate at batch {e['static_batch']} ({static:,.0f} tok/s)"
        )
    return lines


def register(kinds: argparse._SubParsersAction) -> None:
    serve = kinds.add_parser("serve", help="a serving load on the engine per arm: throughput, TTFT, TPOT, ITL")
    model = Flag(help="a checkpoint folder (or smollm2); with --url, the served one's", optional=True)
    add_engine_args(serve, ["model"], model=model)
    serve.add_argument(
        "--random",
        metavar="NAME",
        help=f"write and serve a random checkpoint of {' | '.join(MODELS)} (default: none: give MODEL or --url)",
    )
    serve.add_argument(
        "--scheme",
        default="tensor",
        help=f"FP8 schemes of the --random checkpoints, one checkpoint and arm each, comma-separated: "
        f"{', '.join(SCHEMES)} (default tensor)",
    )
    serve.add_argument("--policy", default="routed", help=f"arms: {', '.join(POLICIES)} (comma-separated)")
    add_engine_args(
        serve, [*AXES, "kv_cache_dtype"], sweep=True,
        enable_prefix_caching=Flag(spelling=AXES["enable_prefix_caching"][0]),  # its name since bench serve began
        async_scheduling=Flag(default=True),  # an arm names a value: on, the engine's own on a GPU
    )  # fmt: skip
    serve.add_argument(
        "--sampling", default="greedy",
        help="what requests ask for: greedy, mixed (top_k, top_p, min_p, penalties, logprobs=5), json (a JSON "
        "schema); a comma-separated list runs each as an arm",
    )  # fmt: skip
    serve.add_argument("--num-prompts", type=int, default=200, help="requests in the load")
    serve.add_argument("--input-len", default="1024:1024", help="prompt tokens A:B, uniform (after the prefix)")
    serve.add_argument("--output-len", default="128:128", help="output tokens A:B, uniform (EOS ignored)")
    serve.add_argument("--request-rate", default="inf", help="requests per second (Poisson), or inf: all at once")
    serve.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    add_engine_args(serve, ENGINE_ARGS)
    serve.add_argument("--lone-prefill", type=int, default=0, help="also time one prefill of this many tokens")
    serve.add_argument("--static-batch", type=int, default=0, help="also time the static generate at this batch")
    serve.add_argument(
        "--seed", type=int, default=0,
        help="seed of the load: its lengths, token ids and arrivals (with --url, also which clients disconnect)",
    )  # fmt: skip
    serve.add_argument("--tmp", help="where random checkpoints are written (default: the system's temp)")
    serve.add_argument("--out", help="directory for the JSON and PNG (default: ./bench-results/<device>/)")
    bench_serve_http.add_args(serve)
    serve.set_defaults(run=run)
