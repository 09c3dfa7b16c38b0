"""`fp8route inspect MODEL`: what an FP8 checkpoint holds (its format and scheme, its layers, scales and
exclusions) and how each layer will run."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

import torch

from fp8route.backends import BACKENDS
from fp8route.backends.problem import GemmProblem
from fp8route.checkpoint.formats import CONFIG
from fp8route.checkpoint.load import Checkpoint, load_checkpoint
from fp8route.checkpoint.quantize import RECORD
from fp8route.cli.quantize import calibration_line
from fp8route.device import DeviceInfo
from fp8route.engine.config import add_engine_args
from fp8route.engine.load import resolve_model
from fp8route.linear.explain import plan_groups
from fp8route.linear.layer import Fp8Linear
from fp8route.models.llama import ARCHITECTURES

# An aligned shape: a backend that refuses it refuses for the device, not for the shape.
_ALIGNED = (4096, 4096)
_ASSUMED_GPU = DeviceInfo.fake_cuda(9, 0, "SM90 (H100/H200), assumed: no GPU on this machine")


def report(ckpt: Checkpoint) -> str:
    linears = ckpt.linears
    members = sum(len(m) for m in ckpt.fused.values())
    fused_kinds: dict[str, int] = {}
    for name in ckpt.fused:
        leaf = name.rpartition(".")[2]
        fused_kinds[leaf] = fused_kinds.get(leaf, 0) + 1
    fp8_bytes = sum(layer.weight.numel() for layer in linears.values())
    kv = (
        f"{ckpt.scheme.kv_cache} ({len(ckpt.kv_scales)} k/v scales)"
        if ckpt.scheme.kv_cache or ckpt.kv_scales
        else "none"
    )
    lines = [
        f"checkpoint: {ckpt.path}",
        f"format: {ckpt.format} (from {ckpt.scheme.source}); kv cache: {kv}",
        f"scheme: {ckpt.fp8_scheme}, {ckpt.scheme.description} ({ckpt.scheme.origin})",
        _config(ckpt),
        f"FP8 linears: {len(linears)} layers from {len(linears) - len(ckpt.fused) + members} checkpoint linears"
        + (f" (fused: {', '.join(f'{n} {k}' for k, n in fused_kinds.items())})" if ckpt.fused else " (not fused)")
        + f", {fp8_bytes / 2**20:.1f} MiB of FP8 weights",
        f"excluded from quantization: {len(ckpt.excluded)}"
        + (f" ({_names(ckpt.excluded)})" if ckpt.excluded else "")
        + f"; config exclusions: {_names(ckpt.scheme.exclude) or 'none'}",
        f"other tensors: {len(ckpt.tensors)}",
        _calibration(ckpt),
        "",
        _stats("weight_scale", {n: layer.weight_scale for n, layer in linears.items()}),
        _stats("input_scale", {n: layer.input_scale for n, layer in linears.items() if layer.input_scale is not None})
        if ckpt.scheme.static_input
        else "input_scale: none (each input is quantized at run time)",
    ]
    if ckpt.fused and ckpt.fp8_scheme != "tensor":
        lines.append(f"fused layers: their members' {ckpt.fp8_scheme} scales concatenated, nothing requantized")
    elif ckpt.fused:
        errors = {n: linears[n].requant_error for n in ckpt.fused}
        worst = max(errors, key=errors.__getitem__)
        lines.append(
            f"fusion requantization error (relative, over the fused weight): max {errors[worst]:.2e} ({worst}), "
            f"mean {sum(errors.values()) / len(errors):.2e}"
        )
    lines += [
        "",
        *gate_failures(list(linears.values())),
        "",
        f"plans on this device ({_device(linears)}):",
        plan_groups(linears.items()),
    ]
    return "\n".join(lines)


def _config(ckpt: Checkpoint) -> str:
    if ckpt.dims is not None:
        return f"{CONFIG}: checked against the tensor shapes: {ckpt.dims.describe()}"
    return (
        f"{CONFIG}: not checked against the tensor shapes (architectures {ckpt.config.get('architectures')}; "
        f"fp8route knows {', '.join(ARCHITECTURES)})"
    )


def _calibration(ckpt: Checkpoint) -> str:
    """The calibration record fp8route quantize writes, or a line saying there is none."""
    qc = ckpt.config.get("quantization_config") or {}
    record = qc.get(RECORD) if isinstance(qc, dict) else None
    if not isinstance(record, dict):
        return "calibration: not recorded (not made by fp8route quantize)"
    return calibration_line(record)


def gate_failures(layers: Sequence[Fp8Linear]) -> list[str]:
    """Shapes some backend refuses for the shape itself, judged on this GPU (or SM90 without one)."""
    first = layers[0].weight.device if layers else torch.device("cpu")
    device = DeviceInfo.of(first) if first.type == "cuda" else _ASSUMED_GPU
    shapes: dict[tuple[int, int], list[str]] = {}
    for layer in layers:
        shapes.setdefault((layer.out_features, layer.in_features), []).append(layer.name)
    failures = []
    for (n, k), names in shapes.items():
        named = [layer for layer in layers if layer.name in names]
        has_bias = any(layer.bias is not None for layer in named)
        static = named[0].input_scale is not None
        shape = GemmProblem(n, k, device, has_bias=has_bias, static_input_scale=static, scheme=named[0].scheme)
        aligned = replace(shape, n=_ALIGNED[0], k=_ALIGNED[1])
        reasons = []
        for backend in BACKENDS.values():
            why = backend.why_not(shape)
            if why is not None and why != backend.why_not(aligned):
                reasons.append(f"{backend.name}: {why}")
        if reasons:
            failures.append(f"  N={n} K={k} ({_names(names)}): " + "; ".join(reasons))
    header = f"shapes failing a backend's gate on {device.label} ({device.name}):"
    return [header, *failures] if failures else [f"{header} none"]


def _stats(label: str, values: dict[str, torch.Tensor]) -> str:
    """min, median and max over every scale of every layer (one a layer per tensor, more per channel or
    block), and the layer holding the largest."""
    if not values:
        return f"{label}: none"
    every = torch.cat([v.detach().float().flatten().cpu() for v in values.values()]).sort().values
    largest = max(values, key=lambda name: float(values[name].max()))
    count = f" over {every.numel()} scales" if every.numel() != len(values) else ""
    return (
        f"{label:<12} min {every[0]:.3e}  median {every[every.numel() // 2]:.3e}  max {every[-1]:.3e} "
        f"({largest}){count}"
    )


def _names(names: Sequence[str], shown: int = 3) -> str:
    head = ", ".join(names[:shown])
    return head + (f" (+{len(names) - shown} more)" if len(names) > shown else "")


def _device(linears: dict[str, Fp8Linear]) -> str:
    layer = next(iter(linears.values()), None)
    return "none" if layer is None else layer.plan.problem.device.label


def run(args: argparse.Namespace) -> int:
    ckpt = load_checkpoint(resolve_model(args.model), device=args.device, fuse=not args.no_fuse)
    print(report(ckpt))
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "inspect", help="load and check an FP8 checkpoint folder and its config; show its scheme and each layer's plan"
    )
    add_engine_args(parser, ["model", "device"])
    parser.add_argument("--no-fuse", action="store_true", help="keep q/k/v and gate/up as separate layers")
    parser.set_defaults(run=run)
