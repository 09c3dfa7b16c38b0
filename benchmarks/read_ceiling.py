"""How fast can any kernel merely read a decode-size weight? The practical ceiling for a GEMV.

The decode targets are stated against the copy bandwidth of a 1 GiB copy. A weight of 4-120 MB is
read in 4-30 µs, where a kernel's ramp-up and drain are a sizable share. This times a Triton kernel
that does nothing but stream the weight's bytes (128-bit loads, one xor-sum per CTA) over a grid of
launch shapes, cold L2 by rotating copies, per call and inside a CUDA graph, and reports the best as a
percentage of the copy bandwidth: no GEMV over the same bytes can beat it.

    PYTHONPATH=$PWD python3 benchmarks/read_ceiling.py --out results/h200/read_ceiling
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from fp8route.tuning.timing import copies_for, copy_bandwidth_gbs, time_arms, time_cold, time_graph

SHAPES = {"tp1_qkv": (6144, 4096), "tp1_o": (4096, 4096), "tp1_gate_up": (28672, 4096), "tp1_down": (4096, 14336)}
CTAS_PER_SM = (1, 2, 4, 8, 16)
WARPS = (4, 8)
INTS_PER_STEP = (2048, 4096)  # int32 loads per CTA per step: 2-8 x 16 bytes per thread


@triton.jit
def _read_kernel(src_ptr, out_ptr, ints_per_cta, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * ints_per_cta + tl.arange(0, BLOCK)
    end = tl.minimum(tl.program_id(0) * ints_per_cta + ints_per_cta, numel)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, ints_per_cta, BLOCK):
        acc ^= tl.load(src_ptr + offs + start, mask=offs + start < end, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def read_calls(weights: list[torch.Tensor], ctas: int, warps: int, block: int) -> list:
    numel = weights[0].numel() // 4
    per_cta = triton.cdiv(triton.cdiv(numel, ctas), block) * block
    grid = triton.cdiv(numel, per_cta)
    out = torch.empty(grid, dtype=torch.int32, device="cuda")
    views = [w.view(torch.int32) for w in weights]
    return [
        lambda v=v: _read_kernel[(grid,)](v, out, per_cta, numel, BLOCK=block, num_warps=warps)  # type: ignore[misc]
        for v in views
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k
        weights = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda").view(torch.uint8)
                   for _ in range(copies_for(nbytes))]  # fmt: skip
        floor_us = nbytes / (copy_gbs * 1e3)
        # Screen every launch shape per call (one rep), then time the best few both ways, twice.
        screened = []
        for per_sm in CTAS_PER_SM:
            for warps in WARPS:
                for block in INTS_PER_STEP:
                    calls = read_calls(weights, per_sm * sms, warps, block)
                    us = statistics.median(time_cold(calls, repeats=20, warmup=1))
                    screened.append((us, per_sm, warps, block))
        screened.sort()
        arms = {f"{p}x{w}w{b}": read_calls(weights, p * sms, w, b) for _, p, w, b in screened[:3]}
        for mode, timer in (("events", time_cold), ("graph", time_graph)):
            timed = time_arms(arms, repeats=30 if mode == "events" else 10, timer=timer)
            for arm, t in timed.items():
                pct = 100 * floor_us / t.median_us
                rows.append({"shape": name, "bytes": nbytes, "arm": arm, "timing": mode, "median_us": t.median_us,
                             "spread": t.spread, "floor_us": floor_us, "pct_copy_bw": pct})  # fmt: skip
        rows.append({"shape": name, "screen": [list(s) for s in screened]})
        del weights
        torch.cuda.empty_cache()
    result = {"copy_gbs": copy_gbs, "command": " ".join(sys.argv), "rows": rows}
    (args.out / "read_ceiling.json").write_text(json.dumps(result, indent=1))
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; best pure read of each weight, cold L2 by rotation")
    print(f"{'shape':12s} {'timing':7s} {'arm':12s} {'µs':>7s} {'spread':>7s} {'floor':>7s} {'% copy bw':>9s}")
    for r in rows:
        if "arm" in r:
            print(f"{r['shape']:12s} {r['timing']:7s} {r['arm']:12s} {r['median_us']:7.2f} {100 * r['spread']:6.1f}%"
                  f" {r['floor_us']:7.2f} {r['pct_copy_bw']:8.1f}%")  # fmt: skip


if __name__ == "__main__":
    main()
