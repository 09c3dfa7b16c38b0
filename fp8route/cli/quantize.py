"""`fp8route quantize SRC DST [--scheme tensor|channel|block] [--format ...]`: an FP8 checkpoint from a
bf16/fp16 one."""

from __future__ import annotations

import argparse
import math
from typing import Any

from fp8route.checkpoint.estimators import DEFAULT_PERCENTILE, ESTIMATORS
from fp8route.checkpoint.formats import DEFAULT_FORMAT, FORMATS
from fp8route.checkpoint.kv_calibration import KV_CACHE
from fp8route.checkpoint.quantize import quantize_checkpoint
from fp8route.engine.config import Flag, add_engine_args
from fp8route.errors import Fp8InputError
from fp8route.progress import TextProgress
from fp8route.schemes import SCHEMES


def run(args: argparse.Namespace) -> int:
    if not 0 < args.max_shard_gb < math.inf:
        raise Fp8InputError(f"--max-shard-gb must be a positive number of GiB, got {args.max_shard_gb}")
    exclude = list(args.exclude or [])
    if not args.quantize_lm_head and "lm_head" not in exclude:
        exclude.append("lm_head")
    result = quantize_checkpoint(
        args.src,
        args.dst,
        format=args.format,
        calib=args.calib,
        exclude=exclude,
        device=args.device,
        max_shard_bytes=max(1, int(args.max_shard_gb * 2**30)),
        progress=None if args.quiet else TextProgress("quantize"),
        calib_text=args.calib_text,
        calib_seq_len=args.calib_seq_len,
        calib_tokens=args.calib_tokens,
        input_scale=args.input_scale,
        percentile=args.percentile,
        keep_float=args.keep_float,
        kl_budget=args.kl_budget,
        kv_cache=args.kv_cache,
        scheme=args.scheme,
    )
    print(
        f"wrote {result.dst} ({result.format}, {result.scheme} scheme): {len(result.quantized)} FP8 linears, "
        f"{len(result.excluded)} excluded ({_first_names(result.excluded)}), {len(result.shards)} shard(s), "
        f"{result.seconds:.1f}s"
    )
    print(calibration_line(result.record))
    if result.kv_scales:
        k = [s for n, s in result.kv_scales.items() if n.endswith("k_scale")]
        v = [s for n, s in result.kv_scales.items() if n.endswith("v_scale")]
        print(
            f"kv cache: fp8 scales for {len(k)} layers, k_scale {min(k):.3g}..{max(k):.3g}, "
            f"v_scale {min(v):.3g}..{max(v):.3g}"
        )
    return 0


_SHOWN = 8  # kept linears named on the line; config.json lists them all


def _first_names(names: list[str]) -> str:
    more = f", +{len(names) - _SHOWN} more in config.json" if len(names) > _SHOWN else ""
    return (", ".join(names[:_SHOWN]) or "none") + more


def calibration_line(record: dict[str, Any]) -> str:
    """One line from a checkpoint's calibration record (quantization_config.fp8route)."""
    scheme = record.get("scheme", "tensor")
    if scheme != "tensor":
        line = f"calibration: no input scales (the {scheme} scheme quantizes each input at run time)"
        cal = record.get("calibration")
        if isinstance(cal, dict):
            line += f"; KV-cache scales on {cal.get('tokens')} tokens of {cal.get('source')}"
        return line
    cal = record.get("calibration", {})
    estimator = cal.get("estimator", "?")
    if estimator == "percentile":
        estimator += f" {cal.get('percentile')}"
    kept = record.get("kept_float") or []
    line = (
        f"calibration: input scales by {estimator} on {cal.get('tokens')} tokens of {cal.get('source')}, "
        f"{cal.get('clipped_linears', 0)} linear(s) clipped below amax/448; kept in float: {len(kept)}"
    )
    if kept:
        errors = record.get("sensitivity", {}).get("kept", {})
        shown = ", ".join(f"{n} {errors[n]:.2e}" if n in errors else n for n in kept[:_SHOWN])
        line += f" ({shown}" + (f", +{len(kept) - _SHOWN} more in config.json)" if len(kept) > _SHOWN else ")")
    search = record.get("kl_budget")
    if isinstance(search, dict):
        line += (
            f"; KL budget {search.get('budget')}: mean KL {search.get('achieved_kl', float('nan')):.4g} "
            f"on the calibration tokens, {len(search.get('trials', []))} trials"
        )
    return line


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "quantize",
        help="make an FP8 checkpoint (per tensor, per channel or 128x128 blocks; ModelOpt, compressed-tensors or "
        "quant_method fp8) from a bf16/fp16 one",
    )
    parser.add_argument(
        "src", help="bf16/fp16 Hugging Face checkpoint folder (Llama-family), or a repository id in the hub cache"
    )
    parser.add_argument("dst", help="new folder to write")
    parser.add_argument(
        "--scheme",
        choices=SCHEMES,
        default="tensor",
        help="tensor: static per-tensor scales (calibrated); channel: a weight scale per output row, inputs "
        "quantized per token at run time (llm-compressor FP8_DYNAMIC); block: a weight scale per 128x128 block, "
        "inputs per 1x128 group at run time (DeepSeek-V3/Qwen3 FP8)",
    )
    defaults = ", ".join(f"{scheme}: {format}" for scheme, format in DEFAULT_FORMAT.items())
    parser.add_argument(
        "--format",
        choices=FORMATS,
        help=f"the checkpoint format to write (default per scheme: {defaults}; fp8 is quant_method fp8)",
    )
    _add_calibration_args(parser)
    _add_exclusion_args(parser)
    calibrate_on = Flag(help="where calibration runs: cuda or cpu (default: cuda when available)")
    add_engine_args(parser, ["device"], device=calibrate_on)
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="largest shard to write, in GiB")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def _add_calibration_args(parser: argparse.ArgumentParser) -> None:
    """What the input (and KV cache) scales are calibrated on, and how they are estimated."""
    calib = parser.add_mutually_exclusive_group()
    calib.add_argument(
        "--calib", help="token ids to calibrate input scales on (.json, .txt or .safetensors); default: generated ones"
    )
    calib.add_argument(
        "--calib-text",
        metavar="FILE",
        help="UTF-8 text to calibrate on, tokenized with SRC's tokenizer.json (documents separated by blank lines) "
        "(default: none)",
    )
    parser.add_argument(
        "--calib-seq-len", type=int, default=512, help="longest calibration sequence, in tokens (--calib-text)"
    )
    parser.add_argument(
        "--calib-tokens", type=int, default=16384, help="calibration tokens in all, at most (--calib-text)"
    )
    parser.add_argument(
        "--input-scale",
        choices=ESTIMATORS,
        default="max",
        help="input scale estimator: max (amax/448), percentile (of |x|) or mse (least output error)",
    )
    parser.add_argument(
        "--percentile",
        type=float,
        default=DEFAULT_PERCENTILE,
        help=f"percentile of |x| for --input-scale percentile, in [90, 100] (default {DEFAULT_PERCENTILE})",
    )
    parser.add_argument(
        "--kv-cache",
        choices=KV_CACHE,
        help="also calibrate FP8 KV-cache scales (amax/448 of the rotated key and the value, per layer), for "
        "kv_cache_dtype='fp8' (default: none)",
    )


def _add_exclusion_args(parser: argparse.ArgumentParser) -> None:
    """Which linears stay in float: by name, or the most sensitive by count or by a KL budget."""
    keep = parser.add_mutually_exclusive_group()
    keep.add_argument(
        "--keep-float",
        type=int,
        default=0,
        metavar="N",
        help="keep the N linears with the largest FP8 output error in bf16 (written unquantized, listed as excluded)",
    )
    keep.add_argument(
        "--kl-budget",
        type=float,
        metavar="X",
        help="keep the fewest of those linears in bf16 (same ranking) so that the model's mean KL(bf16 || fp8) "
        "on the calibration batch is <= X nats, measured by running the model (binary search, ~log2(linears) runs) "
        "(default: none)",
    )
    parser.add_argument(
        "--exclude",
        action="append",
        metavar="PATTERN",
        help="module name or fnmatch wildcard to leave unquantized (repeatable; default: lm_head alone)",
    )
    parser.add_argument("--quantize-lm-head", action="store_true", help="quantize lm_head too (excluded by default)")
