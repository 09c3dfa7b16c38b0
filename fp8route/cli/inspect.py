"""`fp8route inspect MODEL`: what a per-tensor FP8 checkpoint holds and how each layer will run."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

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
        _stats("weight_scale", {n: layer.weight_scale.item() for n, layer in linears.items()}),
        _stats(
            "input_scale",
            {n: layer.input_scale.item() for n, layer in linears.items() if layer.input_scale is not None},
        ),
    ]
    if ckpt.fused:
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
        has_bias = any(layer.bias is not None for layer in layers if layer.name in names)
        reasons = []
        for backend in BACKENDS.values():
            why = backend.why_not(GemmProblem(n, k, device, has_bias=has_bias))
            if why is not None and why != backend.why_not(GemmProblem(*_ALIGNED, device, has_bias=has_bias)):
                reasons.append(f"{backend.name}: {why}")
        if reasons:
            failures.append(f"  N={n} K={k} ({_names(names)}): " + "; ".join(reasons))
    header = f"shapes failing a backend's gate on {device.label} ({device.name}):"
    return [header, *failures] if failures else [f"{header} none"]


def _stats(label: str, values: dict[str, float]) -> str:
    if not values:
        return f"{label}: none"
    ordered = sorted(values.values())
    largest = max(values, key=values.__getitem__)
    return (
        f"{label:<12} min {ordered[0]:.3e}  median {ordered[len(ordered) // 2]:.3e}  max {ordered[-1]:.3e} ({largest})"
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
        "inspect", help="load and check a per-tensor FP8 checkpoint folder (and its config) and show each layer's plan"
    )
    add_engine_args(parser, ["model"])
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--no-fuse", action="store_true", help="keep q/k/v and gate/up as separate layers")
    parser.set_defaults(run=run)
