"""What both drivers of `fp8route bench serve` share (the engine in-process, a server over HTTP): the
load made from the arguments, and the report written as JSON and PNG."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path

from fp8route.bench.workload import LoadRequest, ServeReport, make_load, parse_range, parse_rate
from fp8route.errors import Fp8InputError

LOAD_ARGS = ("num_prompts", "input_len", "output_len", "request_rate", "shared_prefix")


def load_options(args: argparse.Namespace) -> tuple[tuple[int, int], tuple[int, int], float]:
    """(input lengths, output lengths, request rate), checked: call it before any slow set-up."""
    input_len, output_len = parse_range(args.input_len, "--input-len"), parse_range(args.output_len, "--output-len")
    rate = parse_rate(args.request_rate)
    if args.shared_prefix < 0:
        raise Fp8InputError(f"--shared-prefix must be >= 0, got {args.shared_prefix}")
    return input_len, output_len, rate


def loads(args: argparse.Namespace, vocab: int, specials: list[int]) -> tuple[list[LoadRequest], list[LoadRequest]]:
    """(the measured load, a short warm-up at the same prompt sizes) from the load options."""
    input_len, output_len, rate = load_options(args)
    load = make_load(
        args.num_prompts, input_len, output_len, vocab, request_rate=rate, shared_prefix=args.shared_prefix,
        seed=args.seed, special_ids=specials,
    )  # fmt: skip
    warmup = make_load(
        min(8, args.num_prompts), input_len, (2, 4), vocab, shared_prefix=args.shared_prefix,
        seed=args.seed + 1, special_ids=specials,
    )  # fmt: skip
    print(
        f"load: {args.num_prompts} prompts of {args.input_len} tokens (+{args.shared_prefix} shared), "
        f"{args.output_len} out, request rate {args.request_rate}"
    )
    return load, warmup


def write_results(
    args: argparse.Namespace, reports: list[ServeReport], out: Path, stem: str, title: str, where: Mapping[str, object]
) -> None:
    """stem.json (where: the command and where it ran; the load, every report) and stem.png in out."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        **where,
        "load": {k: getattr(args, k) for k in LOAD_ARGS},
        "reports": [r.to_json() for r in reports],
    }
    path = out / f"{stem}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    png = _plot(reports, out / f"{stem}.png", title)
    if png is not None:
        print(f"wrote {png}")


def _plot(reports: list[ServeReport], path: Path, title: str) -> Path | None:
    """TTFT and ITL percentiles per arm; None without matplotlib."""
    from fp8route.tuning.plot import pyplot, save

    plt = pyplot()
    if plt is None or not reports:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, label in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), ("TTFT", "ITL", "end to end"), strict=True):
        names = [r.arm for r in reports]
        for offset, stat in enumerate(("mean", "p50", "p99")):
            xs = [i + 0.25 * offset for i in range(len(reports))]
            ax.bar(xs, [getattr(r, key)[stat] for r in reports], 0.25, label=stat)
        ax.set_xticks([i + 0.25 for i in range(len(reports))], names, rotation=20, fontsize=8)
        ax.set_title(f"{label} ms (lower is better)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    return save(fig, plt, path)
