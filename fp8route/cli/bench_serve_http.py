"""`fp8route bench serve --url URL`: the same load and report as the offline `bench serve`, sent to
any OpenAI-compatible server over HTTP (ours, vLLM's, SGLang's), with clients that give up at
random if asked, and every request accounted for."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from pathlib import Path
from typing import Any

from fp8route.bench.results import load_options, loads, write_results
from fp8route.bench.workload import LoadRequest, ServeReport, summarize, table
from fp8route.checkpoint.formats import CONFIG, read_json
from fp8route.cli.sweep_args import command_line
from fp8route.engine.load import eos_token_ids, resolve_model
from fp8route.errors import Fp8InputError
from fp8route.models.shapes import MODELS

API_KEY_ENV = "FP8ROUTE_API_KEY"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        help="drive the OpenAI-compatible server at this address (http://HOST:PORT) instead "
        "(default: none: the engine, in this process)",
    )
    parser.add_argument(
        "--model", dest="served_model", metavar="NAME",
        help="with --url: the model to ask for (default: the first GET /v1/models lists)",
    )  # fmt: skip
    parser.add_argument("--api-key", help=f"with --url: sent as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    parser.add_argument(
        "--disconnect-fraction", type=float, default=0.0,
        help="with --url: this share of requests closes its stream after a random number of tokens",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-format", choices=("ids", "text"), default="ids",
        help="with --url: send token ids, or their text (needs the checkpoint folder's tokenizer)",
    )  # fmt: skip
    parser.add_argument("--request-timeout", type=float, default=600.0, help="with --url: seconds per request")


def _config(args: argparse.Namespace) -> tuple[dict[str, Any], Path | None]:
    """The served model's config (its vocabulary sizes the load's token ids), and its folder if given."""
    if args.model is not None:
        folder = resolve_model(args.model)
        return read_json(folder / CONFIG), folder
    if args.random is not None:
        if args.random not in MODELS:
            raise Fp8InputError(f"--random: unknown model {args.random!r}; known: {', '.join(MODELS)}")
        return dict(MODELS[args.random]), None
    raise Fp8InputError(
        "--url: also give the served checkpoint's folder as MODEL (or --random NAME for a random one): the load's "
        "token ids must fit its vocabulary"
    )


def _prompts(args: argparse.Namespace, folder: Path | None, load: list[LoadRequest]) -> list[str] | None:
    if args.prompt_format == "ids":
        return None
    if folder is None:
        raise Fp8InputError("--prompt-format text needs the checkpoint folder (for its tokenizer), not --random")
    from fp8route.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    return [tokenizer.decode(r.prompt_ids, skip_special_tokens=False) for r in load]


def run(args: argparse.Namespace) -> int:
    try:
        from fp8route.bench.http import run_http_load
    except ImportError as exc:
        if exc.name != "aiohttp":
            raise
        raise Fp8InputError("--url needs aiohttp: pip install 'fp8route[serve]' (or pip install aiohttp)") from None
    load_options(args)
    url = args.url.rstrip("/")
    if not re.match(r"https?://", url):
        raise Fp8InputError(f"--url: expected http://HOST:PORT, got {args.url!r}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    config, folder = _config(args)
    load, warmup = loads(args, int(config["vocab_size"]), eos_token_ids(config))
    prompts, warm_prompts = _prompts(args, folder, load), _prompts(args, folder, warmup)
    common = {"model": args.served_model, "api_key": api_key, "timeout_s": args.request_timeout}
    warm, _, _, model = asyncio.run(run_http_load(url, warmup, prompts=warm_prompts, **common))
    if warm.lost:
        print(f"warm-up: {warm.lost} of {len(warmup)} requests failed, e.g. {warm.errors[0]}")
    common["model"] = model
    run_, before, after, _ = asyncio.run(
        run_http_load(
            url, load, prompts=prompts, disconnect_fraction=args.disconnect_fraction, seed=args.seed, **common
        )
    )
    outcomes = dict(sorted(run_.outcomes.items()))
    used = after.get("fp8route:kv_cache_used_blocks")
    rss = [m.get("process_resident_memory_bytes") for m in (before, after)]
    engine_rss = [m.get("fp8route:engine_resident_memory_bytes") for m in (before, after)]
    extra: dict[str, object] = {"url": url, "model": model, "requests": len(load), "outcomes": outcomes}
    extra.update({"disconnect_fraction": args.disconnect_fraction, "first_errors": run_.errors})
    if used is not None:
        extra["kv_cache_used_blocks_after"] = used
    if None not in rss:
        extra["server_rss_mb"] = [round(m / 2**20, 1) for m in rss]  # type: ignore[operator]
    if None not in engine_rss:
        extra["engine_rss_mb"] = [round(m / 2**20, 1) for m in engine_rss]  # type: ignore[operator]
    report = summarize(f"http {model}"[:23], run_.results, run_.duration_s, **extra)
    print("\n" + table([report]))
    lines = _checks(report, run_.lost, used)
    print("\n" + "\n".join(lines))
    out = Path(args.out).expanduser() if args.out else Path("bench-results") / "http"
    stem = "serve-http-" + re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_")
    write_results(
        args,
        [report],
        out,
        stem,
        f"{model} at {url}: {args.num_prompts} requests",
        {"command": command_line(), "url": url},
    )
    return 0 if run_.lost == 0 and not used else 1


def _checks(report: ServeReport, lost: int, used: float | None) -> list[str]:
    """Every request accounted for, the pool empty after the run, the server's memory before and after."""
    outcomes: dict[str, int] = report.extra["outcomes"]  # type: ignore[assignment]
    named = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in outcomes.items())
    lines = [f"{report.extra['requests']} requests: {named}; {lost} lost (failed other than 503, or cut short)"]
    if used is None:
        lines.append("KV pool: not checked (the server exports no fp8route:kv_cache_used_blocks)")
    else:
        lines.append("KV pool empty after the run" if not used else f"KV pool: {used:.0f} blocks STILL IN USE")
    for name, mb in (
        ("server", report.extra.get("server_rss_mb")),
        ("engine process", report.extra.get("engine_rss_mb")),
    ):
        if isinstance(mb, list):
            lines.append(f"{name} memory: {mb[0]:.0f} MiB before, {mb[1]:.0f} MiB after")
    return lines
