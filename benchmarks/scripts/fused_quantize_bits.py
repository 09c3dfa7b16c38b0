"""Whether quantize_upstream changes any bits (issue 45). First the fused kernels alone against the
unfused pair (static scale; M 16 and 4096, x and residual of three magnitudes): codes that differ.
Then a random Llama-3.1-8B of LAYERS layers per scheme, one prompt's forward with the option off and on,
every Fp8Linear's output recorded by a hook: each linear that differs, its backend at that M and the
input it took.

    python3 benchmarks/scripts/fused_quantize_bits.py [--schemes tensor,block] [--tokens 4096,16]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch

from fp8route.checkpoint.random import write_random
from fp8route.engine.causal_lm import load_model
from fp8route.engine.config import EngineConfig
from fp8route.kernels.fused import add_rms_norm, rms_norm, silu_mul
from fp8route.kernels.fused_quantize import (
    QuantizedX,
    XQuant,
    add_rms_norm_quantized,
    rms_norm_quantized,
    silu_mul_quantized,
)
from fp8route.kernels.options import set_kernel_options
from fp8route.kernels.quantize import quantize_fp8
from fp8route.linear.layer import Fp8Linear
from fp8route.models.shapes import MODELS


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.uint8) != b.view(torch.uint8)).sum())


def kernels() -> None:
    scale = torch.tensor(8.0 / 448, device="cuda")
    spec = XQuant("tensor", input_scale=scale)
    gen = torch.Generator("cuda").manual_seed(0)
    for m in (16, 4096):
        for std in (0.02, 1.0, 30.0):
            x, r = ((torch.randn(m, 4096, device="cuda", generator=gen) * std).bfloat16() for _ in range(2))
            w = (1 + 0.1 * torch.randn(4096, device="cuda", generator=gen)).bfloat16()
            gate_up = (torch.randn(m, 2 * 14336, device="cuda", generator=gen) * std).bfloat16()
            normed, total = add_rms_norm(x, r, w, 1e-5)
            fused, fused_total = add_rms_norm_quantized(x, r, w, 1e-5, spec)
            counts = {
                "norm": _differ(rms_norm_quantized(x, w, 1e-5, spec).q, quantize_fp8(rms_norm(x, w, 1e-5), scale)),
                "add+norm": _differ(fused.q, quantize_fp8(normed, scale)),
                "its sum": int((fused_total != total).sum()),
                "silu-up": _differ(
                    silu_mul_quantized(gate_up, 14336, spec).q, quantize_fp8(silu_mul(gate_up, 14336), scale)
                ),
            }
            print(f"M={m} std={std}: codes that differ " + ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)


def outputs(path: Path, ids: torch.Tensor, upstream: bool) -> dict[str, tuple[str, str, torch.Tensor]]:
    """name -> (backend, what x was, output) of every linear in one forward of ids."""
    set_kernel_options(quantize_upstream=upstream)
    config = EngineConfig(max_model_len=ids.shape[1] + 8, max_num_batched_tokens=max(8192, ids.shape[1]),
                          enable_prefix_caching=False, max_num_seqs=1, num_kv_blocks=128)  # fmt: skip
    model = load_model(path, config=config, quiet=True)
    seen: dict[str, tuple[str, str, torch.Tensor]] = {}

    def hook(module: Fp8Linear, args: tuple, out: torch.Tensor) -> None:
        x = args[0]
        m = x.rows if isinstance(x, QuantizedX) else x.reshape(-1, x.shape[-1]).shape[0]
        kind = "quantized" if isinstance(x, QuantizedX) else str(x.dtype)
        seen.setdefault(module.name, (module.plan.backend_for(m, torch.bfloat16).name, f"{kind} M={m}", out.clone()))

    handles = [m.register_forward_hook(hook) for m in model.module.modules() if isinstance(m, Fp8Linear)]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    set_kernel_options(quantize_upstream=False)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schemes", default="tensor,block")
    parser.add_argument("--tokens", default="4096,16")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    kernels()
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in args.schemes.split(","):
            path = write_random(Path(tmp) / scheme, {**MODELS["llama-3.1-8b"], "num_hidden_layers": args.layers},
                                fp8=True, scheme=scheme)  # fmt: skip
            for tokens in map(int, args.tokens.split(",")):
                ids = torch.randint(
                    0, 128256, (1, tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(0)
                )
                off, on = outputs(path, ids, False), outputs(path, ids, True)
                print(f"{scheme} {tokens} tokens:", flush=True)
                for name, (backend, x_off, out) in off.items():
                    backend_on, x_on, out_on = on[name]
                    same = torch.equal(out, out_on)
                    diff = (out.float() - out_on.float()).abs().max().item()
                    print(f"  {name:36s} {backend:12s} {x_off:18s} | {backend_on:12s} {x_on:18s} "
                          f"{'equal' if same else f'DIFFER max {diff:.3g}'}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
