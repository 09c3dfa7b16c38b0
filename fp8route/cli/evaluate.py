"""`fp8route eval MODEL --task T [--text FILE] [--compare OTHER]`: log-likelihood accuracy on real
benchmark data, and next-token agreement on a text file.

Scores a checkpoint folder (FP8 or bf16, with its tokenizer.json), or `smollm2`, on hellaswag, arc_easy,
arc_challenge, piqa, winogrande (acc, acc_norm) or gsm8k_bpb (bits per byte), as
lm-evaluation-harness would; --text scores every position of a text file (evaluation/text.py).
With --compare, a second folder is scored on the same batches and the paired difference, top-1
agreement and KL between the two are reported; --backends and --kv-cache-dtype auto,fp8 compare
MODEL with itself the same way, under each backend or KV cache element type. One JSON per task (and
per text) goes to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8route.device import default_device
from fp8route.engine.config import EngineConfig, Flag, add_engine_args, sweep_values
from fp8route.errors import Fp8InputError
from fp8route.evaluation.tasks import TASKS
from fp8route.progress import TextProgress

_DTYPES = ("auto", "float32", "bfloat16")


def _same_tokenizer(a: object, b: object, texts: list[str]) -> bool:
    from fp8route.evaluation.scoring import encode

    return all(encode(a, t) == encode(b, t) for t in texts)


def _slug(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(path).resolve().name) or "model"


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run, for the JSON."""
    words = ["fp8route", "eval", args.model]
    for task in args.task or []:
        words += ["--task", task]
    if args.text is not None:
        words += ["--text", args.text, "--text-seq-len", str(args.text_seq_len)]
    for other in args.compare or []:
        words += ["--compare", other]
    for flag, value in (
        ("--backends", args.backends), ("--kv-cache-dtype", args.kv_cache_dtype), ("--limit", args.limit),
        ("--device", args.device),
    ):  # fmt: skip
        if value is not None:
            words += [flag, str(value)]
    words += [
        "--dtype",
        args.dtype,
        "--batch-size",
        str(args.batch_size),
        "--max-length",
        str(args.max_length),
        "--out",
        args.out,
    ]
    return " ".join(shlex.quote(w) for w in words)


def _result_name(kind: str, labels: list[str]) -> str:
    name = f"{kind}-{labels[0]}" + (f"-vs-{'-'.join(labels[1:])}" if len(labels) > 1 else "")
    return (name if len(name) <= 200 else f"{kind}-{labels[0]}-vs-{len(labels) - 1}-models") + ".json"


def _backend_names(value: str) -> list[str]:
    from fp8route.backends import BACKENDS

    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise Fp8InputError(f"--backends {value}: expected names among {', '.join(BACKENDS)}, comma-separated")
    return list(dict.fromkeys(names))


@dataclass
class Scored:
    """The models of one run, the first the reference, with what the results record of each."""

    models: list[Callable[[Any], Any]] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)
    planned: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    tokenizer: Any = None
    texts: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class Setup:
    """The checked flags: where and in what the models run, and which arms they make."""

    device: str
    dtype: Any  # torch.dtype, or None for the model's own
    backends: list[str | None]
    kv_dtypes: list[str]


def run(args: argparse.Namespace) -> int:
    from fp8route.evaluation.tasks import load_task

    setup = _setup(args)
    tasks = [load_task(name, args.limit) for name in args.task or []]
    scored = _load_models(args, setup, tasks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        _score_task(args, setup, scored, task, out)
    if args.text:
        _score_text(args, setup, scored, out)
    return 0


def _setup(args: argparse.Namespace) -> Setup:
    """Every flag checked, before any model loads."""
    import torch

    device = args.device or default_device().type
    if device not in ("cpu", "cuda"):
        raise Fp8InputError(f"--device {device}: expected cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise Fp8InputError("--device cuda: no CUDA device is visible; use --device cpu")
    if args.dtype not in _DTYPES:
        raise Fp8InputError(f"--dtype {args.dtype}: expected one of {', '.join(_DTYPES)}")
    if device == "cpu":
        EngineConfig().use_cpu_threads()  # as the engine does: every core oversubscribes them
    # On a CPU, bf16 matmuls without bf16 units run ~6x slower than fp32 (16 vs 102 GFLOP/s here).
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (torch.float32 if device == "cpu" else None)
    if not args.task and args.text is None:
        raise Fp8InputError("nothing to evaluate: give --task NAME (repeatable) and/or --text FILE")
    if args.backends is not None and args.compare:
        raise Fp8InputError("--backends compares one folder with itself under each backend; drop --compare")
    backends: list[str | None] = list(_backend_names(args.backends)) if args.backends is not None else [None]
    kv_dtypes = sweep_values(args, "kv_cache_dtype")
    if len(kv_dtypes) > 1 and (args.compare or args.backends is not None):
        raise Fp8InputError(
            "--kv-cache-dtype with several values compares MODEL with itself; drop --compare/--backends"
        )
    return Setup(device, dtype, backends, kv_dtypes)


def _arms(args: argparse.Namespace, setup: Setup) -> list[tuple[str, str, str | None, str]]:
    """(label, model, forced backend, KV cache dtype) of every model to score, the first the reference."""
    backends, kv_dtypes = setup.backends, setup.kv_dtypes
    kv = kv_dtypes[0]
    arms = [(_slug(args.model), args.model, backends[0], kv)]
    arms += [(_slug(p), p, None, kv) for p in args.compare or []]
    arms += [(_slug(args.model), args.model, b, kv) for b in backends[1:]]
    arms += [(_slug(args.model), args.model, None, k) for k in kv_dtypes[1:]]
    return arms


def _load_models(args: argparse.Namespace, setup: Setup, tasks: list[Any]) -> Scored:
    """Every arm's model, each tokenizing as the first does; a forced backend that cannot run the
    model is skipped and said so."""
    from fp8route.engine.load import resolve_model
    from fp8route.errors import BackendUnavailableError
    from fp8route.evaluation.loading import load_for_eval, routes
    from fp8route.evaluation.text import text_sequences
    from fp8route.linear.policy import Policy

    scored = Scored()
    for label, model_name, backend, kv in _arms(args, setup):
        label = label if backend is None else f"{label}@{backend}"
        label += f"@kv-{kv}" if len(setup.kv_dtypes) > 1 or kv != "auto" else ""
        try:
            policy = Policy.from_env(force=backend)
            model, tokenizer = load_for_eval(model_name, setup.device, setup.dtype, policy, kv)
        except BackendUnavailableError as e:
            if backend is None:
                raise
            scored.skipped[backend] = str(e)
            print(f"fp8route eval: skipped backend {backend}: {e}", file=sys.stderr)
            continue
        if scored.tokenizer is None:
            scored.tokenizer = tokenizer
            if args.text:
                scored.texts = text_sequences(args.text, tokenizer, args.text_seq_len, args.limit)
        elif not _same_tokenizer(scored.tokenizer, tokenizer, _probe(scored, tasks)):
            raise Fp8InputError(f"{args.model} and {model_name} tokenize the same text differently")
        while label in scored.labels:
            label += "-2"
        scored.models.append(model)
        scored.labels.append(label)
        scored.paths[label] = str(resolve_model(model_name).resolve())
        scored.planned[label] = routes(model)
    if not scored.models:
        raise Fp8InputError(f"--backends {args.backends}: none of them can run {args.model} on {setup.device}")
    return scored


def _probe(scored: Scored, tasks: list[Any]) -> list[str]:
    """Texts both tokenizers must split alike: a few of every task's requests and of --text."""
    probe = [r.context + r.continuation for t in tasks for e in t.examples[:5] for r in e.requests]
    return probe + [scored.tokenizer.decode(s.tolist()) for s in scored.texts[:2]]


def _score_task(args: argparse.Namespace, setup: Setup, scored: Scored, task: Any, out: Path) -> None:
    from fp8route.evaluation.compare import format_summary, pairwise, summarize
    from fp8route.evaluation.scoring import score_requests

    requests = [r for e in task.examples for r in e.requests]
    start = time.perf_counter()
    progress = None if args.quiet else TextProgress(f"eval {task.name}")
    scores = score_requests(
        scored.models, scored.tokenizer, requests, setup.device, args.batch_size, args.max_length, progress
    )
    seconds = time.perf_counter() - start
    result = summarize(task, scores, scored.labels)
    if args.backends is not None or len(setup.kv_dtypes) > 1:
        result["pairwise"] = pairwise(result["per_example"])
    print(format_summary(result))
    _write(args, setup, scored, result, out / _result_name(task.name, scored.labels), seconds, len(task.examples))


def _score_text(args: argparse.Namespace, setup: Setup, scored: Scored, out: Path) -> None:
    from fp8route.evaluation.text import format_text_summary, score_text, summarize_text

    start = time.perf_counter()
    progress = None if args.quiet else TextProgress("eval text")
    text_scores = score_text(scored.models, scored.texts, setup.device, args.batch_size, progress)
    result = summarize_text(args.text, args.text_seq_len, text_scores, scored.labels)
    print(format_text_summary(result))
    seconds = time.perf_counter() - start
    name = _result_name(f"text-{_slug(Path(args.text).stem)}", scored.labels)
    _write(args, setup, scored, result, out / name, seconds, len(scored.texts), "sequence")


def _write(
    args: argparse.Namespace,
    setup: Setup,
    scored: Scored,
    result: dict[str, Any],
    path: Path,
    seconds: float,
    units: int,
    unit: str = "example",
) -> None:
    """The result as JSON, with the command, the models, their routes and the time it took."""
    result.update(
        command=_command(args),
        paths=scored.paths,
        routes=scored.planned,
        device=setup.device,
        dtype=str(setup.dtype or "model's own").replace("torch.", ""),
        batch_size=args.batch_size,
        seconds=seconds,
        **{f"seconds_per_{unit}": seconds / units},
    )
    if args.backends is not None:
        result["skipped_backends"] = scored.skipped
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"  {seconds:.1f}s ({seconds / units:.3f}s/{unit} on {setup.device}); wrote {path}")


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval", help="log-likelihood accuracy on real benchmark data (hellaswag, arc, piqa, winogrande, gsm8k bpb)"
    )
    add_engine_args(parser, ["model"])
    # Checked by run(), not argparse, so a wrong name is one line on stderr and exit code 2.
    parser.add_argument(
        "--task", action="append", help=f"one of {', '.join(TASKS)} (repeatable; default: none, --text alone)"
    )
    parser.add_argument(
        "--text",
        metavar="FILE",
        help="also score every next token of this UTF-8 text (packed as --calib-text is): NLL, next-token accuracy, "
        "and with --compare top-1 agreement and KL (default: none)",
    )
    parser.add_argument("--text-seq-len", type=int, default=512, help="tokens per packed --text sequence")
    parser.add_argument(
        "--limit", type=int, help="only the first N examples of each task (N sequences of --text) (default: all)"
    )
    parser.add_argument(
        "--compare",
        action="append",
        metavar="OTHER",
        help="another model scored on the same batches, against MODEL (repeatable: MODEL runs once; default: none)",
    )
    parser.add_argument(
        "--backends",
        metavar="A,B,..",
        help="score MODEL (FP8) once per backend, each forced for every layer as FP8ROUTE_FORCE forces it, "
        "against the first; a backend that cannot run a layer is skipped and said so (default: none: as routed)",
    )
    kv_help = (
        "auto, fp8, or auto,fp8 (MODEL scored with each, against the first); fp8 rounds every layer's K and V "
        "through e4m3 with the checkpoint's k/v scales, as if every position were read back from an fp8 cache"
    )
    add_engine_args(parser, ["kv_cache_dtype"], sweep=True, kv_cache_dtype=Flag(help=kv_help))
    # Not the engine's dtype: what eval's full forward computes in, "auto" among them (checked by _setup).
    eval_dtype = Flag(
        "auto", "activations: float32, bfloat16 or auto (float32 on cpu, the model's on cuda)", choices=_DTYPES
    )
    add_engine_args(parser, ["device", "dtype"], dtype=eval_dtype)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    parser.add_argument("--max-length", type=int, default=2048, help="longest context+continuation, in tokens")
    parser.add_argument("--out", default="eval-results", help="folder for the JSON results")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)
