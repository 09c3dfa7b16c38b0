"""Prefill: how much of the routed layer sum is the activation quantization pass, and where the
GEMMs alone sit against the floor (the figure the 1.05x target was set on).

Per Llama-3.1-8B TP1 shape and M >= 2048, timed together (cold L2 by rotating weight copies, two
reps in mirrored order, fp8route.tuning.timing): the quantization pass alone, cuBLASLt per-tensor
on an already-quantized x (default and fast accumulation), and the same with the pass included.

    PYTHONPATH=. python3 benchmarks/prefill_quant.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fp8route.kernels.quantize import quantize_fp8
from fp8route.models.shapes import model_shapes
from fp8route.tuning import timing
from fp8route.tuning.ceilings import measure_ceilings
from fp8route.tuning.report import gemm_bytes, gemm_flops

FP8 = torch.float8_e4m3fn
MS = (2048, 4096, 8192)


def arms_for(n: int, k: int, m: int) -> dict[str, list]:
    copies = timing.copies_for(n * k)
    ws = [(torch.randn(n, k, device="cuda") * 0.02 / (0.08 / 448)).to(FP8) for _ in range(copies)]
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    s_in, s_w = torch.tensor(8.0 / 448, device="cuda"), torch.tensor(0.08 / 448, device="cuda")
    xq = quantize_fp8(x, s_in)

    def gemm(w: torch.Tensor, a: torch.Tensor, fast: bool) -> torch.Tensor:
        return torch._scaled_mm(a, w.t(), s_in, s_w, out_dtype=torch.bfloat16, use_fast_accum=fast)

    return {
        "quant": [lambda: quantize_fp8(x, s_in)] * copies,
        "cublas": [lambda w=w: gemm(w, xq, False) for w in ws],
        "cublas_fast": [lambda w=w: gemm(w, xq, True) for w in ws],
        "quant+cublas_fast": [lambda w=w: gemm(w, quantize_fp8(x, s_in), True) for w in ws],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    ceilings = measure_ceilings("cuda")
    shapes = model_shapes("llama-3.1-8b", tp=1)
    rows, lines = [], [f"ceilings: copy {ceilings.copy_gbs:.0f} GB/s, FP8 {ceilings.fp8_tflops:.0f} TFLOP/s"]
    for m in MS:
        sums: dict[str, float] = {}
        floor = 0.0
        for s in shapes:
            timed = timing.time_arms(arms_for(s.n, s.k, m))
            f = ceilings.floor_us(gemm_flops(m, s.n, s.k), gemm_bytes(m, s.n, s.k))
            floor += f
            for arm, t in timed.items():
                sums[arm] = sums.get(arm, 0.0) + t.median_us
                rows.append({"shape": s.label, "m": m, "arm": arm, "median_us": t.median_us, "spread": t.spread})
            torch.cuda.empty_cache()
        lines.append(
            f"M={m:5d} layer sum: floor {floor:7.1f} µs | "
            + " | ".join(f"{a} {v:7.1f} ({v / floor:.3f}x)" for a, v in sums.items() if a != "quant")
            + f" | quant pass alone {sums['quant']:.1f} µs ({sums['quant'] / sums['quant+cublas_fast']:.1%})"
        )
        print(lines[-1], flush=True)
    Path(args.out, "prefill_quant.json").write_text(json.dumps({"rows": rows, "summary": lines}, indent=1))


if __name__ == "__main__":
    main()
