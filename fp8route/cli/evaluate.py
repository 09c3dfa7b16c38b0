"""`fp8route eval PATH --task T [--text FILE] [--compare OTHER]`: log-likelihood accuracy on real
benchmark data, and next-token agreement on a text file.

Scores a checkpoint folder (FP8 or bf16, with its tokenizer.json) on hellaswag, arc_easy,
arc_challenge, piqa, winogrande (acc, acc_norm) or gsm8k_bpb (bits per byte), as
lm-evaluation-harness would; --text scores every position of a text file (evaluation/text.py).
With --compare, a second folder is scored on the same batches and the paired difference, top-1
agreement and KL between the two are reported. One JSON per task (and per text) goes to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path

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
    for flag, value in (("--limit", args.limit), ("--compare", args.compare), ("--device", args.device)):
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


def run(args: argparse.Namespace) -> int:
    import torch

    from fp8route.evaluation.compare import format_summary, summarize
    from fp8route.evaluation.loading import load_for_eval
    from fp8route.evaluation.scoring import score_requests
    from fp8route.evaluation.tasks import load_task
    from fp8route.evaluation.text import format_text_summary, score_text, summarize_text, text_sequences

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
        tasks = [load_task(name, args.limit) for name in args.task or []]
        model, tokenizer = load_for_eval(args.path, device, dtype)
        texts = text_sequences(args.text, tokenizer, args.text_seq_len, args.limit) if args.text else []
        models, labels = [model], [_slug(args.path)]
        if args.compare:
            other, other_tokenizer = load_for_eval(args.compare, device, dtype)
            probe = [r.context + r.continuation for t in tasks for e in t.examples[:5] for r in e.requests]
            probe += [tokenizer.decode(s.tolist()) for s in texts[:2]]
            if not _same_tokenizer(tokenizer, other_tokenizer, probe):
                raise Fp8InputError(f"{args.path} and {args.compare} tokenize the same text differently")
            other_label = _slug(args.compare)
            models.append(other)
            labels.append(other_label if other_label != labels[0] else other_label + "-2")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        pair = f"{labels[0]}" + (f"-vs-{labels[1]}" if len(labels) > 1 else "")

        def write(result: dict[str, object], name: str, seconds: float, units: int, unit: str) -> None:
            result.update(
                command=_command(args),
                paths={
                    label: str(Path(p).resolve()) for label, p in zip(labels, [args.path, args.compare], strict=False)
                },
                device=device,
                dtype=str(dtype or "model's own").replace("torch.", ""),
                batch_size=args.batch_size,
                seconds=seconds,
                **{f"seconds_per_{unit}": seconds / units},
            )
            (out / name).write_text(json.dumps(result, indent=1) + "\n")
            print(f"  {seconds:.1f}s ({seconds / units:.3f}s/{unit} on {device}); wrote {out / name}")

        for task in tasks:
            requests = [r for e in task.examples for r in e.requests]
            start = time.perf_counter()
            progress = None if args.quiet else TextProgress(f"eval {task.name}")
            scores = score_requests(models, tokenizer, requests, device, args.batch_size, args.max_length, progress)
            seconds = time.perf_counter() - start
            result = summarize(task, scores, labels)
            print(format_summary(result))
            write(result, f"{task.name}-{pair}.json", seconds, len(task.examples), "example")
        if args.text:
            start = time.perf_counter()
            progress = None if args.quiet else TextProgress("eval text")
            text_scores = score_text(models, texts, device, args.batch_size, progress)
            result = summarize_text(args.text, args.text_seq_len, text_scores, labels)
            print(format_text_summary(result))
            seconds = time.perf_counter() - start
            write(result, f"text-{_slug(Path(args.text).stem)}-{pair}.json", seconds, len(texts), "sequence")
    except Fp8RouteError as e:
        print(f"fp8route eval: {e}", file=sys.stderr)
        return 2
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval", help="log-likelihood accuracy on real benchmark data (hellaswag, arc, piqa, winogrande, gsm8k bpb)"
    )
    parser.add_argument(
        "path", help="checkpoint folder: FP8 (ModelOpt/compressed-tensors) or bf16, with tokenizer.json"
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
    parser.add_argument("--compare", metavar="OTHER_PATH", help="a second folder, scored on the same examples")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--dtype", default="auto", help="activations: float32, bfloat16 or auto (float32 on cpu, the model's on cuda)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    parser.add_argument("--max-length", type=int, default=2048, help="longest context+continuation, in tokens")
    parser.add_argument("--out", default="eval-results", help="folder for the JSON results (default ./eval-results)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)
