"""The decode kernels under Nsight Compute: one profiled call per (shape, arm) at one M.

Run it under ncu, which profiles only between cudaProfilerStart/Stop (everything before is warm-up
and compilation) and, with its default cache control, starts every kernel with a flushed L2:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        python3 benchmarks/ncu_decode.py --m 1 --cuda-core 16,512,1,3

Arms: ours (the configuration fp8_gemv.choose_config picks), ours_prequant (the same on x quantized
upstream, to tell the fused quantization's cost from the GEMM's), ours_cuda_core (the CUDA-core
kernel with the block_n,block_k,num_warps,num_stages given, split for about 4 CTAs per SM), and
cuBLASLt on pre-quantized x (GEMM only) after the standalone quantization kernel. Shapes: those of
decode_bench.py (`--shapes tp4_gate_up,tp4_down`); `--nvtx` on ncu names each kernel's arm.

    python3 benchmarks/ncu_decode.py --summarize ncu.txt   # one line per profiled kernel
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
from decode_bench import SHAPES

from fp8route.kernels.decode_gemm import configs
from fp8route.kernels.decode_gemm.launch import decode_gemm
from fp8route.kernels.quantize import quantize_fp8
from fp8route.quant import FP8_DTYPE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summarize", type=Path, help="print a table of an ncu report (text) instead of profiling")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--cuda-core", default="", help="block_n,block_k,num_warps,num_stages[,split] of the CUDA-core arm")
    ap.add_argument("--shapes", default="tp1_qkv,tp1_o,tp1_gate_up,tp1_down")
    args = ap.parse_args()
    if args.summarize:
        print(summarize(args.summarize.read_text()))
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    s_in = torch.tensor(4.0 / 448, device="cuda")
    s_w = torch.tensor(1.0 / 448, device="cuda")
    runs = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device="cuda", generator=gen) * 150).clamp(-448, 448).to(FP8_DTYPE)
        x = torch.randn(args.m, k, device="cuda", generator=gen).to(torch.bfloat16)
        xq = quantize_fp8(x, s_in)
        arms = {
            "ours": lambda x=x, w=w: decode_gemm(x, w, s_w, s_in, None, torch.bfloat16),
            "ours_prequant": lambda xq=xq, w=w: decode_gemm(xq, w, s_w, s_in, None, torch.bfloat16),
        }
        if args.cuda_core:
            bn, bk, warps, stages, *split = (int(v) for v in args.cuda_core.split(","))
            tiles = -(-n // bn)
            split_k = split[0] if split else max(1, min(k // bk, 4 * 132 // tiles))  # about 4 CTAs per SM
            cfg = configs.DecodeConfig(bn, bk, 1 << (args.m - 1).bit_length(), split_k, warps, stages, True)
            arms["ours_cuda_core"] = lambda x=x, w=w, cfg=cfg: decode_gemm(
                x, w, s_w, s_in, None, torch.bfloat16, config=cfg
            )
        arms["cublas"] = lambda x=x, w=w: torch._scaled_mm(
            quantize_fp8(x, s_in), w.t(), s_in, s_w, out_dtype=torch.bfloat16
        )
        for arm, call in arms.items():
            for _ in range(3):
                call()
            runs.append((name, arm, call))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, arm, call in runs:
        torch.cuda.nvtx.range_push(f"{name}/{arm}")
        call()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(f"{n}/{a}" for n, a, _ in runs))


def summarize(report: str) -> str:
    """One line per kernel of an ncu text report (SpeedOfLight, LaunchStats, Occupancy, WarpStateStats
    sections; stall reasons need `--print-details all`)."""
    header = (
        f"{'arm':26s} {'kernel':18s} {'grid':>9s} {'thr':>4s} {'us':>6s} {'dram%':>6s} {'smact%':>6s} {'regs':>4s} "
        f"{'smemKB':>6s} {'occ%':>5s} {'cyc/iss':>7s}  top stalls (cycles per issued instruction)"
    )
    lines = [header]
    for block in re.split(r"\n  (?=\S+ \(\d+, \d+, \d+\)x\()", report)[1:]:
        head = re.match(r"(\S+) \((\d+), (\d+), \d+\)x\((\d+)", block)
        if head is None:
            continue
        kernel, grid_x, grid_y, threads = head.groups()
        arm = re.search(r"<\d+,([^>]+)>", block)
        active = float(_metric(block, "SM Active Cycles")) / float(_metric(block, "Elapsed Cycles"))
        stalls = sorted(
            ((float(v), name) for name, v in re.findall(r"^\s+Stall ([A-Za-z ]+?)\s+inst\s+([\d.]+)\s*$", block, re.M)),
            reverse=True,
        )
        lines.append(
            f"{arm.group(1) if arm else '?':26s} {kernel[:18]:18s} {grid_x + 'x' + grid_y:>9s} {threads:>4s} "
            f"{_metric(block, 'Duration'):>6s} {_metric(block, 'DRAM Throughput'):>6s} {100 * active:6.1f} "
            f"{_metric(block, 'Registers Per Thread'):>4s} {_metric(block, 'Dynamic Shared Memory Per Block'):>6s} "
            f"{_metric(block, 'Achieved Occupancy'):>5s} {_metric(block, 'Warp Cycles Per Issued Instruction'):>7s}  "
            + ", ".join(f"{name} {v:.2f}" for v, name in stalls[:4])
        )
    return "\n".join(lines)


def _metric(block: str, name: str) -> str:
    found = re.search(rf"^\s+{re.escape(name)}\s+(?:\S+\s+)?([\d,.]+)\s*$", block, re.M)
    return found.group(1).replace(",", "") if found else "?"


if __name__ == "__main__":
    main()
