"""Where the wgmma decode kernel (fp8route/kernels/fp8_mma.py) spends its time: the kernel against
itself with the wgmmas left out (each A fragment XOR-folded into one accumulator instead), on bf16
and on pre-quantized x, per config; cold L2 by rotating copies (fp8route.bench.timing).

    python3 benchmarks/exp_wgmma_probe.py [--ncu]   # --ncu: one call per case, for ncu --profile-from-start off
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_bench import SHAPES, Operands  # noqa: E402

from fp8route.bench.timing import time_cold  # noqa: E402
from fp8route.kernels import fp8_mma as fm  # noqa: E402

WITHOUT_MMA = {
    "wgmma_k32<NT>(part[rg], lo.x, hi.x, lo.y, hi.y, d0);": (
        "part[rg][0] += __int_as_float((lo.x ^ hi.x ^ lo.y ^ hi.y ^ (u32)d0) & 0x007fffff);"
    ),
    "wgmma_k32<NT>(part[rg], lo.z, hi.z, lo.w, hi.w, d1);": (
        "part[rg][1] += __int_as_float((lo.z ^ hi.z ^ lo.w ^ hi.w ^ (u32)d1) & 0x007fffff);"
    ),
}
CASES = [  # shape, M, configs
    ("tp4_gate_up", 1, [fm.MmaConfig(1, 1, 4, 4), fm.MmaConfig(1, 2, 4, 4), fm.MmaConfig(2, 1, 2, 4)]),
    ("tp4_gate_up", 32, [fm.MmaConfig(1, 1, 4, 4), fm.MmaConfig(1, 2, 2, 4), fm.MmaConfig(2, 1, 2, 2)]),
    ("tp1_down", 1, [fm.MmaConfig(1, 1, 4, 8), fm.MmaConfig(1, 2, 4, 8)]),
]


def use_source(without_mma: bool) -> None:
    original = fm._source.__wrapped__() if hasattr(fm._source, "__wrapped__") else fm._source()
    text = original
    if without_mma:
        for a, b in WITHOUT_MMA.items():
            assert a in text, a
            text = text.replace(a, b)
    fm._source = lambda: text  # type: ignore[assignment]
    fm._kernel.cache_clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16
    rows = []
    for without in (False, True):
        use_source(without)
        for name, m, configs in CASES:
            ops = Operands(*SHAPES[name], m, gen)
            for cfg in configs:
                for xs, label in ((ops.x, "bf16"), (ops.xq, "fp8")):
                    calls = [
                        lambda i=i, xs=xs, c=cfg, o=ops: fm.launch(xs[i], o.w[i], o.s_w, o.s_in, None, bf16, config=c)
                        for i in range(ops.copies)
                    ]
                    if args.ncu:
                        for call in calls[:3]:
                            call()
                        torch.cuda.synchronize()
                        torch.cuda.cudart().cudaProfilerStart()
                        calls[3]()
                        torch.cuda.synchronize()
                        torch.cuda.cudart().cudaProfilerStop()
                        continue
                    us = statistics.median(time_cold(calls, repeats=30))
                    rows.append((name, m, str(cfg), label, "no mma" if without else "full", us))
                    print(f"{name:12s} M={m:3d} {label} {'no mma' if without else 'full  '} {us:7.2f} µs {cfg}")
            del ops
        if args.ncu:
            break


if __name__ == "__main__":
    main()
