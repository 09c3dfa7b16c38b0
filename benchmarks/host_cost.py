"""Host (CPU) time of one eager call at M=1: a routed Fp8Linear against a bare torch._scaled_mm, in
one run. Calls are queued back to back with no sync; the time per call is the host's, since the
GPU finishes each of these small GEMMs faster than the host issues the next.

    python3 benchmarks/host_cost.py [--n 6144 --k 4096 --calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fp8route
from fp8route.linear.policy import Policy


def per_call_us(fn, calls: int, reps: int = 5) -> list[float]:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) * 1e6 / calls)
        torch.cuda.synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=6144)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    w, scale = fp8route.quantize_per_tensor(torch.randn(args.n, args.k, device="cuda") * 0.02)
    x = torch.randn(1, args.k, device="cuda", dtype=torch.bfloat16)
    x_q = x.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    arms = {"bare _scaled_mm (x pre-quantized)": lambda: torch._scaled_mm(
        x_q, w.t(), scale_a=one, scale_b=scale, out_dtype=torch.bfloat16)}  # fmt: skip
    for backend in ("cublas", "fp8_gemv"):
        layer = fp8route.Fp8Linear(w, scale, 0.02, policy=Policy(force=backend))
        arms[f"Fp8Linear forced {backend} (quantizes x)"] = lambda layer=layer: layer(x)
    layer = fp8route.Fp8Linear(w, scale, 0.02)
    fp8route.route(torch.nn.Sequential(layer))
    arms[f"Fp8Linear routed ({layer.plan.backend_for(1, torch.bfloat16).name})"] = lambda: layer(x)
    print(f"host µs per eager call at M=1, {args.n}x{args.k}, {args.calls} calls x 5 reps (median [min-max])")
    for name, fn in arms.items():
        times = per_call_us(fn, args.calls)
        print(f"  {name:<45} {statistics.median(times):6.1f}  [{min(times):.1f}-{max(times):.1f}]")


if __name__ == "__main__":
    main()
