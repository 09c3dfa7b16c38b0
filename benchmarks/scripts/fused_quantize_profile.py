"""Where the quantize_upstream option gains or loses (issue 45): every kernel of one prefill and of one
decode step of a short random Llama-3.1-8B (its first LAYERS layers), option off and on, per scheme,
read through torch.profiler; and the fused producers alone against the unfused pair at a few M.

    python3 benchmarks/scripts/fused_quantize_profile.py --out $OUT [--schemes tensor,block] [--layers 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from fp8route.bench.step_split import kernel_times
from fp8route.checkpoint.random import write_random
from fp8route.engine.causal_lm import load_model
from fp8route.engine.config import EngineConfig
from fp8route.kernels.fused import add_rms_norm, rms_norm, silu_mul
from fp8route.kernels.fused_quantize import XQuant, add_rms_norm_quantized, rms_norm_quantized, silu_mul_quantized
from fp8route.kernels.options import set_kernel_options
from fp8route.kernels.quantize import quantize_fp8, quantize_per_group, quantize_per_token
from fp8route.models.shapes import MODELS

HIDDEN, INTER = 4096, 14336


def _by_name(fn, repeats: int = 3) -> dict[str, float]:  # noqa: ANN001
    """Device us per call of fn, summed by kernel name (after two warm-up calls)."""
    fn()
    fn()
    totals: dict[str, float] = defaultdict(float)
    for kernel in kernel_times(lambda: [fn() for _ in range(repeats)]) or []:
        totals[kernel.name] += kernel.ms * 1e3 / repeats
    return dict(totals)


def _quantizer(spec: XQuant):  # noqa: ANN202
    if spec.scheme == "tensor":
        return lambda x: quantize_fp8(x, spec.input_scale)
    if spec.scheme == "channel":
        return quantize_per_token
    return lambda x: quantize_per_group(x, m_major=spec.m_major)


def _pairs(x: torch.Tensor, r: torch.Tensor, gu: torch.Tensor, w: torch.Tensor, spec: XQuant) -> dict:
    """op -> (the unfused pair, the fused kernel) for one spec."""
    quant = _quantizer(spec)
    pairs = {
        "norm": (lambda: quant(rms_norm(x, w, 1e-5)), lambda: rms_norm_quantized(x, w, 1e-5, spec)),
        "add_norm": (
            lambda: quant(add_rms_norm(x, r, w, 1e-5)[0]),
            lambda: add_rms_norm_quantized(x, r, w, 1e-5, spec),
        ),
    }
    if spec.scheme != "channel":
        pairs["silu_mul"] = (lambda: quant(silu_mul(gu, INTER)), lambda: silu_mul_quantized(gu, INTER, spec))
    return pairs


def kernels_alone(ms: list[int]) -> list[dict]:
    scale = torch.tensor(8.0 / 448, device="cuda")
    specs = {"tensor": XQuant("tensor", input_scale=scale), "channel": XQuant("channel"),
             "block": XQuant("block"), "block m_major": XQuant("block", m_major=True, rows=4)}  # fmt: skip
    w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    rows = []
    for m in ms:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        gu = torch.randn(m, 2 * INTER, device="cuda", dtype=torch.bfloat16)
        for label, spec in specs.items():
            for op, (unfused, fused) in _pairs(x, r, gu, w, spec).items():
                a, b = _by_name(unfused), _by_name(fused)
                row = {"m": m, "spec": label, "op": op, "unfused_us": sum(a.values()), "fused_us": sum(b.values()),
                       "unfused": a, "fused": b}  # fmt: skip
                rows.append(row)
                ratio = row["fused_us"] / max(row["unfused_us"], 1e-9)
                print(f"M={m:5d} {label:14s} {op:9s} unfused {row['unfused_us']:8.1f} us  "
                      f"fused {row['fused_us']:8.1f} us  ({ratio:.2f}x)", flush=True)  # fmt: skip
    return rows


def model_kernels(scheme: str, layers: int, prompt: int, folder: Path) -> list[dict]:
    config = {**MODELS["llama-3.1-8b"], "num_hidden_layers": layers}
    path = write_random(folder / scheme, config, fp8=True, scheme=scheme)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 128256, (1, prompt), device="cuda", generator=gen)
    rows = []
    for upstream in (False, True):
        set_kernel_options(quantize_upstream=upstream)
        engine = EngineConfig(max_model_len=prompt + 64, max_num_batched_tokens=max(8192, prompt),
                              enable_prefix_caching=False, max_num_seqs=1, gpu_memory_utilization=0.4)  # fmt: skip
        model = load_model(path, config=engine, quiet=True)
        for what, fn in (("prefill", lambda m=model: m.generate(ids, 1)),
                         ("prefill+16", lambda m=model: m.generate(ids, 17))):  # fmt: skip
            totals = _by_name(fn)
            top = sorted(totals.items(), key=lambda kv: -kv[1])[:14]
            rows.append({"scheme": scheme, "upstream": upstream, "what": what, "total_us": sum(totals.values()),
                         "kernels": totals})  # fmt: skip
            print(f"\n{scheme} upstream={'on' if upstream else 'off'} {what}: {sum(totals.values()):.0f} us of kernels")
            for name, us in top:
                print(f"  {us:9.1f}  {name[:110]}")
        del model, fn
        gc.collect()
        torch.cuda.empty_cache()
    set_kernel_options(quantize_upstream=False)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--schemes", default="tensor,block")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--ms", default="1,16,4096")
    args = parser.parse_args()
    alone = kernels_alone([int(m) for m in args.ms.split(",")])
    models = []
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in args.schemes.split(","):
            models += model_kernels(scheme, args.layers, args.prompt, Path(tmp))
    (args.out / "fused_quantize_profile.json").write_text(json.dumps({"alone": alone, "models": models}, indent=1))
    print("\nscheme  what         off us    on us")
    for scheme in args.schemes.split(","):
        for what in ("prefill", "prefill+16"):
            off, on = (next(r["total_us"] for r in models if (r["scheme"], r["what"], r["upstream"]) == key)
                       for key in ((scheme, what, False), (scheme, what, True)))  # fmt: skip
            print(f"{scheme:7s} {what:10s} {off:9.0f} {on:9.0f}  ({on / off:.3f}x)")


if __name__ == "__main__":
    main()
