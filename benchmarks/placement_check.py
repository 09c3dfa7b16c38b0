"""Does where a weight lands in memory change a kernel's time? (Repeatability of the tuner across processes.)

The same cuBLASLt kernel (same nvjet name) on the same Llama-3.1-8B gate_up weight ran 34.9 µs in
one process and 36.0 µs in the next, while fp8_gemv went 35.8 -> 33.7 µs, so the route flipped;
inside either process two reps agreed within 1%. A process's only other difference is where its
rotating weight copies were allocated. This allocates several independent sets of copies (a
differently sized spacer allocation before each, so the sets land at different addresses), times
both arms on each set, twice, and prints per set the times and their ratio.

--vary activations keeps one set of weight copies and gives each set its own x instead: within
one process cuBLASLt ran the same kernel on the same weight copies 8% slower at one M than at the
M on either side (gate_up M=8 or M=16, depending on the process: results/h200/routing/steady/),
and x, read by every CTA, is what a new M reallocates.

    PYTHONPATH=$PWD python3 benchmarks/placement_check.py --out DIR [--vary activations --m 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from fp8route.kernels.decode_gemm.launch import decode_gemm
from fp8route.kernels.quantize import quantize_fp8
from fp8route.tuning.timing import copies_for, time_arms

FP8 = torch.float8_e4m3fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--sets", type=int, default=6)
    ap.add_argument("--vary", choices=("weights", "activations"), default="weights")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    n, k, m = args.n, args.k, args.m
    gen = torch.Generator(device="cuda").manual_seed(0)
    s_in = torch.tensor(4.0 / 448, device="cuda")
    s_w = torch.tensor(1.0 / 448, device="cuda")
    base = (torch.randn(n, k, device="cuda", generator=gen) * 150).clamp(-448, 448).to(FP8)
    x0 = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    copies = copies_for(n * k)
    keep = []  # spacers and sets stay allocated, so every set has its own addresses
    rows = []
    ws = [base.clone() for _ in range(copies)]
    for s in range(args.sets):
        # Spacers of MBs move a weight set; an odd number of KBs moves a small x to other lines.
        spacer = (s * 37 + 5) << 20 if args.vary == "weights" else (s * 37 + 5) << 10
        keep.append(torch.empty(spacer, dtype=torch.uint8, device="cuda"))
        if args.vary == "weights":
            ws = [base.clone() for _ in range(copies)]
            keep.append(ws)
        x = x0.clone()
        keep.append(x)
        arms = {
            "fp8_gemv": [lambda w=w, x=x: decode_gemm(x, w, s_w, s_in, None, torch.bfloat16) for w in ws],
            "cublas+quant": [
                lambda w=w, x=x: torch._scaled_mm(quantize_fp8(x, s_in), w.t(), s_in, s_w, out_dtype=torch.bfloat16)
                for w in ws
            ],
        }
        timed = time_arms(arms, repeats=30)
        row = {
            "set": s,
            "addresses": [hex(w.data_ptr()) for w in ws],
            "x_address": hex(x.data_ptr()),
            **{
                a: {"median_us": t.median_us, "reps": list(t.rep_medians_us), "spread": t.spread}
                for a, t in timed.items()
            },  # fmt: skip
        }
        row["ratio"] = row["cublas+quant"]["median_us"] / row["fp8_gemv"]["median_us"]
        rows.append(row)
        print(
            f"set {s} ({copies} copies from {row['addresses'][0]}, x at {row['x_address']}):\n"
            f"  fp8_gemv {row['fp8_gemv']['median_us']:6.2f} "
            f"(spread {100 * row['fp8_gemv']['spread']:.1f}%)  cublas+quant {row['cublas+quant']['median_us']:6.2f} "
            f"(spread {100 * row['cublas+quant']['spread']:.1f}%)  cublas+quant / fp8_gemv {row['ratio']:.3f}",
            flush=True,
        )
    for arm in ("fp8_gemv", "cublas+quant"):
        v = [r[arm]["median_us"] for r in rows]
        spread = (max(v) - min(v)) / statistics.median(v)
        print(f"{arm}: across sets {min(v):.2f}..{max(v):.2f} µs ({100 * spread:.1f}%)")
    ratios = [r["ratio"] for r in rows]
    print(f"ratio across sets {min(ratios):.3f}..{max(ratios):.3f}")
    (args.out / f"placement_{args.vary}_{n}x{k}_m{m}.json").write_text(
        json.dumps({"command": " ".join(sys.argv), "vary": args.vary, "copies": copies, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
