"""`fp8route demo`: a small FP8 model from random weights, planned, explained, run and checked."""

from __future__ import annotations

import argparse

import torch
from torch import nn

from fp8route.backends import BACKENDS
from fp8route.device import default_device
from fp8route.engine.config import Flag, add_engine_args, check_setting
from fp8route.errors import Fp8InputError
from fp8route.linear.explain import explain
from fp8route.linear.layer import Fp8Linear
from fp8route.linear.policy import Policy
from fp8route.quant import FLOAT_DTYPE_NAMES, FP8_MAX, sqnr_db
from fp8route.routing.apply import route


class DemoBlock(nn.Module):
    """The four projections of a Llama block. Attention is left out (this demo is about the
    linears): o_proj reads the query slice of qkv_proj's output."""

    def __init__(self, hidden: int, intermediate: int, kv_dim: int) -> None:
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.qkv_proj: nn.Module = nn.Linear(hidden, hidden + 2 * kv_dim, bias=False)
        self.o_proj: nn.Module = nn.Linear(hidden, hidden, bias=False)
        self.gate_up_proj: nn.Module = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj: nn.Module = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.o_proj(self.qkv_proj(x)[..., : self.hidden])
        gate, up = self.gate_up_proj(h).split(self.intermediate, dim=-1)
        return h + self.down_proj(nn.functional.silu(gate) * up)


def build_float_model(hidden: int, intermediate: int, layers: int, dtype: torch.dtype, device: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(DemoBlock(hidden, intermediate, hidden // 4) for _ in range(layers)))
    for name, p in model.named_parameters():
        fan_in = p.shape[1]
        # down_proj and o_proj write into the residual stream: smaller, as trained models keep them.
        scale = 0.5 if name.endswith(("down_proj.weight", "o_proj.weight")) else 1.0
        nn.init.normal_(p, std=scale * fan_in**-0.5)
    return model.to(device=device, dtype=dtype)


@torch.no_grad()
def quantize_model(model: nn.Module, calibration: torch.Tensor, policy: Policy) -> nn.Module:
    """Swap every nn.Linear for an Fp8Linear whose static input scale is amax/448 of its input
    over the calibration batch."""
    amax: dict[str, float] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda m, args, name=name: amax.__setitem__(name, max(amax.get(name, 0.0), args[0].abs().max().item()))
        )
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    ]
    model(calibration)
    for hook in hooks:
        hook.remove()
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                full = f"{name}.{child_name}" if name else child_name
                fp8 = Fp8Linear.from_float(child, input_scale=max(amax[full], 1e-6) / FP8_MAX, name=full, policy=policy)
                setattr(module, child_name, fp8)
    return model


def run_demo(args: argparse.Namespace) -> int:
    check_setting("dtype", args.dtype, "--dtype")
    for flag in ("layers", "tokens", "hidden", "intermediate"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise Fp8InputError(f"--{flag} must be at least 1, got {value}")
    device = default_device(args.device).type
    dtype = FLOAT_DTYPE_NAMES[args.dtype]
    # On a GPU the blocks take Llama-3.1-8B's shapes, so the shipped routing table applies as tuned.
    hidden, intermediate = (4096, 14336) if device == "cuda" else (1024, 3584)
    args.hidden, args.intermediate = args.hidden or hidden, args.intermediate or intermediate
    float_model = build_float_model(args.hidden, args.intermediate, args.layers, dtype, device)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    with torch.no_grad():
        expected = float_model(x)
        model = quantize_model(
            build_float_model(args.hidden, args.intermediate, args.layers, dtype, device), x, Policy.from_env()
        )
        route(model)
    print(
        f"fp8route demo on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}), {args.dtype}, "
        f"{args.layers} blocks, hidden {args.hidden}, intermediate {args.intermediate}, {args.tokens} tokens\n"
    )
    print(explain(model))
    with torch.no_grad():
        routed, worst_layer, worst = run_checked(model, x)
    tolerance = 1e-2 if dtype != torch.float32 else 1e-5
    print(
        f"\nevery layer vs the fp32 reference on the same FP8 operands: worst relative error {worst:.2e} "
        f"({worst_layer}; tolerance {tolerance:.0e}), NaNs in the output: {int(routed.isnan().sum())}"
    )
    sqnr = sqnr_db(expected.float(), routed.float())
    print(f"FP8 model vs the {args.dtype} model it was quantized from: SQNR {sqnr:.1f} dB")
    ok = worst <= tolerance and not routed.isnan().any()
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1


def run_checked(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, str, float]:
    """Run the model as planned; check each layer's output against the reference backend on the
    very input that layer saw. (Comparing whole models instead would mostly measure how one
    rounding difference flips later FP8 roundings, not whether a kernel is right.)"""
    errors: dict[str, float] = {}

    def check(layer: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        assert isinstance(layer, Fp8Linear)
        x2d = args[0].reshape(-1, args[0].shape[-1])
        expected = BACKENDS["reference"].run(x2d, layer.prepared).float()
        diff = (out.reshape(expected.shape).float() - expected).norm() / expected.norm().clamp(min=1e-30)
        errors[layer.name] = diff.item()

    hooks = [m.register_forward_hook(check) for m in model.modules() if isinstance(m, Fp8Linear)]
    try:
        out = model(x)
    finally:
        for hook in hooks:
            hook.remove()
    worst_layer = max(errors, key=errors.__getitem__)
    return out, worst_layer, errors[worst_layer]


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("demo", help="build, plan, explain, run and check a random FP8 model of Llama blocks")
    add_engine_args(parser, ["device", "dtype"], dtype=Flag(help="activations and outputs"))
    parser.add_argument("--hidden", type=int, help="default: 4096 on a GPU (Llama-3.1-8B), 1024 on a CPU")
    parser.add_argument("--intermediate", type=int, help="default: 14336 on a GPU, 3584 on a CPU")
    parser.add_argument("--layers", type=int, default=2, help="Llama blocks in the model")
    parser.add_argument("--tokens", type=int, default=33, help="tokens in the batch it runs (M)")
    parser.set_defaults(run=run_demo)
