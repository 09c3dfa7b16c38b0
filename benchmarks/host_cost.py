"""Host (CPU) time of one eager call at M=1: a routed Fp8Linear against a bare torch._scaled_mm, in
one run. Calls are queued back to back with no sync; the time per call is the host's, since the
GPU finishes each of these small GEMMs faster than the host issues the next.

    python3 benchmarks/host_cost.py [--n 6144 --k 4096 --calls 2000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import fp8route
from fp8route.linear.policy import Policy
from fp8route.routing.fingerprint import Fingerprint


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
    parser.add_argument("--profile", action="store_true", help="cProfile the routed layer's calls")
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
    routed = f"Fp8Linear routed ({layer.plan.backend_for(1, torch.bfloat16).name})"
    arms[routed] = lambda: layer(x)
    arms |= kernel_arms(x, w, scale, layer.input_scale)
    print(f"on {Fingerprint.of('cuda').summary()}")
    print(f"host µs per eager call at M=1, {args.n}x{args.k}, {args.calls} calls x 5 reps (median [min-max])")
    for name, fn in arms.items():
        times = per_call_us(fn, args.calls)
        print(f"  {name:<45} {statistics.median(times):6.1f}  [{min(times):.1f}-{max(times):.1f}]")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [arms[routed]() for _ in range(args.calls)])
        torch.cuda.synchronize()
        print(f"\n{routed}: where the host time goes ({args.calls} calls, cProfile adds its own overhead)")
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


def kernel_arms(x, w, w_scale, x_scale) -> dict:
    """The decode GEMM's Triton kernel launched through Triton's own path and through ours."""
    from fp8route.kernels.decode_gemm import launch as decode_launch

    m, k = x.shape
    n = w.shape[0]
    decode_launch.launch(x, w, w_scale, x_scale, None, torch.bfloat16)  # the plan of this shape
    plan = next(p for key, p in decode_launch._LAUNCHES.items() if key[:3] == (m, n, k))
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    ws, cnt = out, out
    if plan.split > 1:
        ws, cnt = torch.empty(plan.split, m, n, device=x.device), decode_launch._counters(x.device, plan.tiles)
    args = (x, w, out, out, ws, cnt, w_scale, x_scale, m, n, k, k, k, n, plan.split, plan.k_per_split)
    key = ("host_cost", m, n, k)
    return {
        "decode kernel, triton's launch": lambda: plan.kernel.fn[plan.grid](*args, **plan.meta),
        "decode kernel, DirectLauncher": lambda: plan.kernel(plan.grid, key, args, plan.meta),
        "decode_gemm launch() (allocates)": lambda: decode_launch.launch(x, w, w_scale, x_scale, None, torch.bfloat16),
    }


if __name__ == "__main__":
    main()
