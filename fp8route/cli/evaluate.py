"""`fp8route eval PATH --task T [--text FILE] [--compare OTHER]`: log-likelihood accuracy on real
benchmark data, and next-token agreement on a text file.

Scores a checkpoint folder (FP8 or bf16, with its tokenizer.json) on hellaswag, arc_easy,
arc_challenge, piqa, winogrande (acc, acc_norm) or gsm8k_bpb (bits per byte), as
lm-evaluation-harness would; --text scores every position of a text file (evaluation/text.py).
With --compare, a second folder is scored on the same batches and the paired difference, top-1
agreement and KL between the two are reported; --backends and --kv-cache-dtype auto,fp8 compare
PATH with itself the same way, under each backend or KV cache element type. One JSON per task (and
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
from pathlib import Path
from typing import Any

from fp8route.errors import Fp8InputError, Fp8RouteError
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
    words = ["fp8route", "eval", args.path]
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


def run(args: argparse.Namespace) -> int:
    import torch

    from fp8route.checkpoint.hub import resolve_model_path
    from fp8route.engine.kv_quant import kv_cache_dtype_list
    from fp8route.errors import BackendUnavailableError
    from fp8route.evaluation.compare import format_summary, pairwise, summarize
    from fp8route.evaluation.loading import load_for_eval, routes
    from fp8route.evaluation.scoring import score_requests
    from fp8route.evaluation.tasks import load_task
    from fp8route.evaluation.text import format_text_summary, score_text, summarize_text, text_sequences
    from fp8route.linear.policy import Policy

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if device not in ("cpu", "cuda"):
            raise Fp8InputError(f"--device {device}: expected cpu or cuda")
        if device == "cuda" and not torch.cuda.is_available():
            raise Fp8InputError("--device cuda: no CUDA device is visible; use --device cpu")
        if args.dtype not in _DTYPES:
            raise Fp8InputError(f"--dtype {args.dtype}: expected one of {', '.join(_DTYPES)}")
        # On a CPU, bf16 matmuls without bf16 units run ~6x slower than fp32 (16 vs 102 GFLOP/s here).
        dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (torch.float32 if device == "cpu" else None)
        if not args.task and args.text is None:
            raise Fp8InputError("nothing to evaluate: give --task NAME (repeatable) and/or --text FILE")
        if args.backends is not None and args.compare:
            raise Fp8InputError("--backends compares one folder with itself under each backend; drop --compare")
        backends = _backend_names(args.backends) if args.backends is not None else [None]
        kv_dtypes = kv_cache_dtype_list(args.kv_cache_dtype)
        if len(kv_dtypes) > 1 and (args.compare or args.backends is not None):
            raise Fp8InputError(
                "--kv-cache-dtype with several values compares PATH with itself; drop --compare/--backends"
            )
        tasks = [load_task(name, args.limit) for name in args.task or []]
        # (label, path, forced backend, KV cache dtype) of every model, the first the reference.
        kv = kv_dtypes[0]
        wanted = [(_slug(args.path), args.path, backends[0], kv)] + [
            (_slug(p), p, None, kv) for p in args.compare or []
        ]
        wanted += [(_slug(args.path), args.path, b, kv) for b in backends[1:]]
        wanted += [(_slug(args.path), args.path, None, k) for k in kv_dtypes[1:]]
        models: list[Callable[[Any], Any]] = []
        labels: list[str] = []
        paths: dict[str, str] = {}
        planned: dict[str, dict[str, Any]] = {}
        skipped: dict[str, str] = {}
        tokenizer: Any = None
        texts: list[Any] = []
        for label, path, backend, kv in wanted:
            label = label if backend is None else f"{label}@{backend}"
            label += f"@kv-{kv}" if len(kv_dtypes) > 1 or kv != "auto" else ""
            try:
                model, other_tokenizer = load_for_eval(path, device, dtype, Policy.from_env(force=backend), kv)
            except BackendUnavailableError as e:
                if backend is None:
                    raise
                skipped[backend] = str(e)
                print(f"fp8route eval: skipped backend {backend}: {e}", file=sys.stderr)
                continue
            if tokenizer is None:
                tokenizer = other_tokenizer
                texts = text_sequences(args.text, tokenizer, args.text_seq_len, args.limit) if args.text else []
            else:
                probe = [r.context + r.continuation for t in tasks for e in t.examples[:5] for r in e.requests]
                probe += [tokenizer.decode(s.tolist()) for s in texts[:2]]
                if not _same_tokenizer(tokenizer, other_tokenizer, probe):
                    raise Fp8InputError(f"{args.path} and {path} tokenize the same text differently")
            while label in labels:
                label += "-2"
            models.append(model)
            labels.append(label)
            paths[label] = str(resolve_model_path(path).resolve())
            planned[label] = routes(model)
        if not models:
            raise Fp8InputError(f"--backends {args.backends}: none of them can run {args.path} on {device}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)

        def write(result: dict[str, Any], name: str, seconds: float, units: int, unit: str) -> None:
            result.update(
                command=_command(args),
                paths=paths,
                routes=planned,
                device=device,
                dtype=str(dtype or "model's own").replace("torch.", ""),
                batch_size=args.batch_size,
                seconds=seconds,
                **{f"seconds_per_{unit}": seconds / units},
            )
            if args.backends is not None:
                result["skipped_backends"] = skipped
            (out / name).write_text(json.dumps(result, indent=1) + "\n")
            print(f"  {seconds:.1f}s ({seconds / units:.3f}s/{unit} on {device}); wrote {out / name}")

        for task in tasks:
            requests = [r for e in task.examples for r in e.requests]
            start = time.perf_counter()
            progress = None if args.quiet else TextProgress(f"eval {task.name}")
            scores = score_requests(models, tokenizer, requests, device, args.batch_size, args.max_length, progress)
            seconds = time.perf_counter() - start
            result = summarize(task, scores, labels)
            if args.backends is not None or len(kv_dtypes) > 1:
                result["pairwise"] = pairwise(result["per_example"])
            print(format_summary(result))
            write(result, _result_name(task.name, labels), seconds, len(task.examples), "example")
        if args.text:
            start = time.perf_counter()
            progress = None if args.quiet else TextProgress("eval text")
            text_scores = score_text(models, texts, device, args.batch_size, progress)
            result = summarize_text(args.text, args.text_seq_len, text_scores, labels)
            print(format_text_summary(result))
            seconds = time.perf_counter() - start
            write(result, _result_name(f"text-{_slug(Path(args.text).stem)}", labels), seconds, len(texts), "sequence")
    except Fp8RouteError as e:
        print(f"fp8route eval: {e}", file=sys.stderr)
        return 2
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval", help="log-likelihood accuracy on real benchmark data (hellaswag, arc, piqa, winogrande, gsm8k bpb)"
    )
    parser.add_argument(
        "path",
        help="checkpoint folder: FP8 (ModelOpt/compressed-tensors) or bf16, with tokenizer.json; or a repository id "
        "in the Hugging Face hub cache",
    )
    # Checked by run(), not argparse, so a wrong name is one line on stderr and exit code 2.
    parser.add_argument("--task", action="append", help=f"one of {', '.join(TASKS)} (repeatable)")
    parser.add_argument(
        "--text",
        metavar="FILE",
        help="also score every next token of this UTF-8 text (packed as --calib-text is): NLL, next-token accuracy, "
        "and with --compare top-1 agreement and KL",
    )
    parser.add_argument("--text-seq-len", type=int, default=512, help="tokens per packed --text sequence")
    parser.add_argument("--limit", type=int, help="only the first N examples of each task (N sequences of --text)")
    parser.add_argument(
        "--compare",
        action="append",
        metavar="OTHER_PATH",
        help="another folder scored on the same batches, against PATH (repeatable: PATH runs once)",
    )
    parser.add_argument(
        "--backends",
        metavar="A,B,..",
        help="score PATH (FP8) once per backend, each forced for every layer as FP8ROUTE_FORCE forces it, "
        "against the first; a backend that cannot run a layer is skipped and said so",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto, fp8, or auto,fp8 (PATH scored with each, against the first); fp8 rounds every layer's K and V "
        "through e4m3 with the checkpoint's k/v scales, as if every position were read back from an fp8 cache",
    )
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--dtype", default="auto", help="activations: float32, bfloat16 or auto (float32 on cpu, the model's on cuda)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    parser.add_argument("--max-length", type=int, default=2048, help="longest context+continuation, in tokens")
    parser.add_argument("--out", default="eval-results", help="folder for the JSON results (default ./eval-results)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)
