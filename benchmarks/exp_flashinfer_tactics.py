"""Experiment: does choosing cuBLASLt's algorithm by measurement (FlashInfer's autotuned bmm_fp8)
bring the prefill GEMMs closer to the floor than cuBLASLt's heuristic? Not a backend until it wins.

Issue 4 asks for the routed Llama-3.1-8B TP1 layer sum within 1.05x of the floor at M >= 2048 and
names FlashInfer's cuBLAS tactics as a candidate. flashinfer.bmm_fp8(backend="cublas") runs the
heuristic's first algorithm; inside flashinfer.autotune() it times every algorithm cuBLASLt offers
for the shape and keeps the fastest for that M bucket (in-process). Per TP1 shape and M, x given in
e4m3 (the GEMMs alone): cuBLASLt and its fast accumulation through torch._scaled_mm and bmm_fp8 as
it comes, timed together at every M; then bmm_fp8 tuned for each M in turn, timed together with
fast accumulation again. Each
output is checked against the fp32 reference first. Needs flashinfer (the device run installs it
from carried wheels).

    PYTHONPATH=$PWD python3 benchmarks/exp_flashinfer_tactics.py --out DIR [--ms 2048,4096,8192]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8route.bench.ceilings import measure_ceilings  # noqa: E402
from fp8route.bench.report import gemm_bytes, gemm_flops  # noqa: E402
from fp8route.bench.timing import ArmTiming, copies_for, time_arms  # noqa: E402

FP8 = torch.float8_e4m3fn
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def arms_for(x: torch.Tensor, weights: list[torch.Tensor], ref: torch.Tensor) -> dict[str, list]:
    """Per arm one call per weight copy, each arm checked against the reference first."""
    import flashinfer

    m, n, one = x.shape[0], weights[0].shape[0], torch.ones((), device=x.device)
    kinds = {
        "cublas": lambda w: torch._scaled_mm(x, w.t(), one, one, out_dtype=torch.bfloat16),
        "cublas_fast": lambda w: torch._scaled_mm(x, w.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True),
        "bmm_fp8": lambda w: flashinfer.bmm_fp8(
            x.unsqueeze(0), w.t().unsqueeze(0), one.reshape(1), one.reshape(1), torch.bfloat16, backend="cublas"
        ).view(m, n),
    }
    arms = {}
    for name, fn in kinds.items():
        err = ((fn(weights[0]).float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{name} {n}x{x.shape[1]} M={m}: {err:.1e} off the reference"
        arms[name] = [lambda fn=fn, w=w: fn(w) for w in weights]
    return arms


def main() -> None:
    import flashinfer
    from flashinfer.autotuner import autotune

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", default="2048,4096,8192")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ms = [int(v) for v in args.ms.split(",")]
    ceilings = measure_ceilings()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []

    def record(shape: str, n: int, k: int, m: int, phase: str, timed: dict[str, ArmTiming]) -> None:
        floor = ceilings.floor_us(gemm_flops(m, n, k), gemm_bytes(m, n, k, 2))
        for arm, t in timed.items():
            rows.append({"shape": shape, "n": n, "k": k, "m": m, "phase": phase, "arm": arm,
                         "median_us": t.median_us, "spread": t.spread, "floor_us": floor})  # fmt: skip
            print(f"{shape:8s} M={m:6d} {phase:9s} {arm:12s} {t.median_us:9.1f} µs ({100 * t.spread:.1f}%) "
                  f"{t.median_us / floor:.3f}x floor", flush=True)  # fmt: skip

    for shape, (n, k) in SHAPES.items():
        base = (torch.randn(n, k, device="cuda", generator=gen) * 100).clamp(-448, 448).to(FP8)
        weights = [base.clone() for _ in range(copies_for(n * k))]
        xs = {m: (torch.randn(m, k, device="cuda", generator=gen) * 100).clamp(-448, 448).to(FP8) for m in ms}
        arms = {m: arms_for(x, weights, x.float() @ base.float().t()) for m, x in xs.items()}
        # Every M as it comes before any is tuned: a tuned M bucket would also serve the M values near it.
        for m in ms:
            record(shape, n, k, m, "heuristic", time_arms(arms[m], repeats=20))
        for m in ms:
            began = time.perf_counter()
            with autotune(True, tuning_buckets=(m,)):
                arms[m]["bmm_fp8"][0]()
            torch.cuda.synchronize()
            print(f"{shape:8s} M={m:6d} autotune took {time.perf_counter() - began:.1f} s", flush=True)
            tuned = {"cublas_fast": arms[m]["cublas_fast"], "bmm_fp8 tuned": arms[m]["bmm_fp8"]}
            record(shape, n, k, m, "tuned", time_arms(tuned, repeats=20))
        del xs, arms
        weights.clear()
        torch.cuda.empty_cache()

    print("\nlayer sum / floor (qkv + o + gate_up + down):")
    for m in ms:
        line = []
        for phase, arm in (("heuristic", "cublas"), ("heuristic", "cublas_fast"), ("heuristic", "bmm_fp8"),
                           ("tuned", "cublas_fast"), ("tuned", "bmm_fp8 tuned")):  # fmt: skip
            sel = [r for r in rows if r["m"] == m and r["phase"] == phase and r["arm"] == arm]
            if len(sel) == len(SHAPES):
                total, floor = sum(r["median_us"] for r in sel), sum(r["floor_us"] for r in sel)
                line.append(f"{arm} ({phase}) {total / floor:.3f}x")
        print(f"  M={m}: " + ", ".join(line))
    doc = {"command": " ".join(sys.argv), "ceilings": ceilings.to_json(), "flashinfer": flashinfer.__version__}
    (args.out / "flashinfer_tactics.json").write_text(json.dumps({**doc, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
