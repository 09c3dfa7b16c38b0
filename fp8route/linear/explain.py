"""Print what every Fp8Linear in a model (or a loaded checkpoint) will run, and why the rest will not."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from fp8route.backends.base import Backend
from fp8route.kernels.options import kernel_options
from fp8route.linear.layer import Fp8Linear
from fp8route.linear.plan import Plan, size_text


class HasLinears(Protocol):
    """A loaded checkpoint (fp8route.Checkpoint): its layers by module name."""

    linears: dict[str, Fp8Linear]


def explain(model: nn.Module | HasLinears) -> str:
    """One block per distinct plan; layers that share a plan are listed together; last, the memory
    the plans' prepared operands cost over all layers. A tensor-parallel rank's layers show its
    local shapes, under a line that names the rank."""
    if isinstance(model, nn.Module):
        layers: list[tuple[str, Fp8Linear]] = [
            (name or m.name, m) for name, m in model.named_modules() if isinstance(m, Fp8Linear)
        ]
    else:
        layers = list(getattr(model, "linears", {}).items())
    text = "no Fp8Linear layers in this model"
    if layers:
        linears = [m for _, m in layers]
        text = f"{plan_groups(layers)}\n\n{options_line()}\n{upstream_line(linears)}\n{prepared_total(linears)}"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        text = f"rank {dist.get_rank()} of {dist.get_world_size()}: N and K as this rank holds them\n\n{text}"
    return text


def options_line() -> str:
    """The kernel options now (fp8route.set_kernel_options), and where they act."""
    options = kernel_options()
    pdl = "on" if options.pdl else "off (an engine on Hopper measures each decode graph with it unless its config says)"
    return f"kernel options: pdl {pdl}, quantize_upstream {'on' if options.quantize_upstream else 'off'}"


def upstream_line(layers: list[Fp8Linear]) -> str:
    """One line: where x reaches a layer quantized by the norm or SiLU-up kernel before it."""
    if not kernel_options().quantize_upstream:
        return "x quantized upstream: nowhere (kernel option quantize_upstream off)"
    counts: dict[str, int] = {}
    for layer in layers:
        for name in layer.upstream_quantized:
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        return "x quantized upstream: nowhere (every route quantizes x itself or inside its GEMM)"
    where = ", ".join(f"{name} ({n} layers)" for name, n in sorted(counts.items()))
    return f"x quantized upstream, by the norm or SiLU-up before a fused qkv, gate_up or down, on routes to: {where}"


def prepared_total(layers: Iterable[Fp8Linear]) -> str:
    """One line: what every layer's plan made at plan time, summed, beside the e4m3 weights."""
    plans = [layer.plan for layer in layers]
    made = sum(sum(plan.prepared_bytes.values()) for plan in plans)
    weights = sum(plan.problem.n * plan.problem.k for plan in plans)
    what = size_text(made) if made else "nothing"
    return f"made at plan time, all {len(plans)} layers: {what} (their e4m3 weights: {size_text(weights)})"


def plan_groups(layers: Iterable[tuple[str, Fp8Linear]]) -> str:
    """Layers grouped by what their plans say (everything but the layer's name), one block each."""
    groups: dict[tuple[object, ...], tuple[Plan, list[str]]] = {}
    for name, layer in layers:
        plan = layer.plan
        groups.setdefault(plan_key(plan), (plan, []))[1].append(name)
    blocks = []
    for plan, names in groups.values():
        shown = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} more with the same plan)"
        blocks.append(plan.explain(layer=shown))
    return "\n\n".join(blocks)


def plan_key(plan: Plan) -> tuple[object, ...]:
    """Everything a plan says except the name of its layer."""
    return (plan.problem, plan.bounds, _names(plan.routes), _names(plan.quantized_routes), plan.excluded,
            plan.fallbacks, plan.source)  # fmt: skip


def _names(routes: dict[torch.dtype, tuple[Backend, ...]]) -> tuple[object, ...]:
    return tuple((dtype, tuple(b.name for b in route)) for dtype, route in routes.items())
