"""Decode-size FP8 linears on one GPU: our fused-quant split-K kernel against cuBLASLt and CUTLASS.

Arms per (N, K, M), all timed with fp8route.tuning.timing (CUDA events, cold L2 by rotating operand
copies, two reps in mirrored order):
  ours          fp8_gemv on bf16 x (quantization fused)
  ours_prequant fp8_gemv on an already-quantized x (GEMM only)
  cublas+quant  one quantization kernel + torch._scaled_mm per-tensor (cuBLASLt)
  cublas        torch._scaled_mm per-tensor on quantized x (GEMM only)
  rowwise+quant one quantization kernel + torch._scaled_mm with (M,1)/(1,N) scales (CUTLASS)
With --graph, every arm is also timed inside one CUDA graph per arm (the rotating copies back to
back, as a decode step replays them): launch gaps shrink to a graph's, which is what a served model
pays. With --sweep, every candidate configuration of ours is timed too (one rep) and the best kept as
`ours_best`, which is how the table in fp8_gemv.choose_config was made (--sweep-kinds: the wgmma
kernel's configurations, the CUDA-core kernel's at M <= 8, or both).

    PYTHONUNBUFFERED=1 python benchmarks/decode_bench.py --out results/   [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from fp8route.device import DeviceInfo
from fp8route.kernels.decode_gemm import configs
from fp8route.kernels.decode_gemm.launch import decode_gemm
from fp8route.kernels.quantize import quantize_fp8
from fp8route.tuning.timing import copies_for, copy_bandwidth_gbs, time_arms, time_cold, time_graph


def choose_config(m: int, n: int, k: int) -> configs.DecodeConfig:
    """The configuration the kernel picks on this GPU."""
    return configs.choose_config(m, n, k, DeviceInfo.of("cuda"))


FP8 = torch.float8_e4m3fn
SHAPES = {  # name: (N, K)
    "tp1_qkv": (6144, 4096),
    "tp1_o": (4096, 4096),
    "tp1_gate_up": (28672, 4096),
    "tp1_down": (4096, 14336),
    "tp2_qkv": (3072, 4096),
    "tp2_o": (4096, 2048),
    "tp2_gate_up": (14336, 4096),
    "tp2_down": (4096, 7168),
    "tp4_qkv": (1536, 4096),
    "tp4_o": (4096, 1024),
    "tp4_gate_up": (7168, 4096),
    "tp4_down": (4096, 3584),
}
MS = (1, 2, 4, 8, 16, 32, 64, 128)
# (block_n, block_k, num_stages, num_warps) per block_m; each compiles for sm_90 without register
# spills, in shared memory for one or two CTAs per SM (cuobjdump --dump-resource-usage).
SWEEP_BLOCKS = {
    16: ((256, 128, 4, 8), (128, 256, 3, 8), (128, 128, 5, 8), (64, 128, 6, 4), (128, 256, 2, 8), (256, 128, 2, 8),
         (256, 256, 2, 8), (128, 128, 3, 4), (64, 256, 3, 4), (128, 512, 2, 8)),
    32: ((128, 128, 4, 8), (64, 256, 4, 8), (256, 128, 3, 8)),
    64: ((128, 64, 6, 8), (128, 128, 4, 8), (256, 64, 4, 8)),
}  # fmt: skip
SWEEP_MS = (1, 2, 4, 8, 16)
# The CUDA-core kernel, M <= 8: (block_n, block_k, num_warps, num_stages). block_k 512 puts a warp's
# 32 lanes along K (64: 4 along K x 8 rows), so each row's sum costs 5 shuffles (2); every lane
# quantizes its 16 x values per K-step for the block_n / num_warps rows it holds, so fewer warps
# per row block re-quantize x less often. num_stages > 1: weight tiles staged by cp.async.
CUDA_CORE_BLOCKS = (
    (16, 512, 4, 1), (16, 512, 4, 3), (32, 512, 4, 3), (16, 512, 1, 3), (16, 512, 2, 3), (32, 512, 2, 3),
    (64, 512, 4, 3), (8, 512, 1, 3), (16, 1024, 2, 3), (64, 256, 4, 3), (128, 64, 4, 3),
)  # fmt: skip


def fingerprint() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        driver = None
    return {
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def sweep_configs(
    m: int, n: int, k: int, num_sms: int, kinds: str = "wgmma",
    cuda_core_blocks: tuple[tuple[int, ...], ...] = CUDA_CORE_BLOCKS, block_ms: tuple[int, ...] = (),
) -> list[configs.DecodeConfig]:  # fmt: skip
    """The configs to time at one (M, N, K). block_ms: wgmma token tiles to try besides the one
    covering M (a smaller one runs M in several token tiles that share each weight tile via L2)."""
    out = []
    if "cuda_core" in kinds and m <= configs.CUDA_CORE_M_MAX:
        block_m = 1 << (m - 1).bit_length()
        for block_n, block_k, warps, stages, *maxnreg in cuda_core_blocks:
            k_iters, tiles = k // block_k, -(-n // block_n)
            for split in (1, 2, 3, 4, 6, 7, 8, 12, 14, 16):
                if k_iters % split == 0 and (split == 1 or num_sms // 2 <= tiles * split <= 16 * num_sms):
                    cfg = configs.DecodeConfig(block_n, block_k, block_m, split, warps, stages, True, *maxnreg)
                    out.append(cfg)
    if "wgmma" not in kinds:
        return out
    own = configs.block_m_for(m)
    for block_m in sorted({own, *(b for b in block_ms if b < own)}):
        for block_n, block_k, stages, warps in SWEEP_BLOCKS[block_m]:
            k_iters = k // block_k
            slots = num_sms * configs.ctas_per_sm(block_n, block_k, block_m, stages)
            tiles = -(-n // block_n) * -(-m // block_m)
            for split in range(1, min(32, k_iters) + 1):
                uneven = k_iters % split != 0
                if uneven and (block_m > 16 or -(-k_iters // split) * (split - 1) >= k_iters):
                    continue  # uneven splits only at decode sizes, and none that leave a split empty
                if split == 1 or slots // 2 <= tiles * split <= 3 * slots:
                    out.append(configs.DecodeConfig(block_n, block_k, block_m, split, warps, stages))
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


class Operands:
    """Rotating copies of one layer's operands (weights together > 3x L2) at the largest M."""

    def __init__(self, n: int, k: int, m_max: int, gen: torch.Generator):
        self.n, self.k = n, k
        self.copies = copies_for(n * k)
        self.w, self.x, self.xq = [], [], []
        self.s_in = torch.tensor(4.0 / 448, device="cuda")  # x ~ N(0,1): |x| <= 4 sigma maps to 448
        self.s_w = torch.tensor(1.0 / 448, device="cuda")
        for _ in range(self.copies):
            w = (torch.randn(n, k, device="cuda", generator=gen) * 150).clamp(-448, 448).to(FP8)
            x = torch.randn(m_max, k, device="cuda", generator=gen).to(torch.bfloat16)
            self.w.append(w)
            self.x.append(x)
            self.xq.append(quantize_fp8(x, self.s_in))
        self.rows_in = self.s_in.expand(m_max, 1).contiguous()
        self.cols_w = self.s_w.expand(1, n).contiguous()

    def reference(self, m: int) -> torch.Tensor:
        q = (self.x[0][:m].float() / self.s_in).clamp(-448, 448).to(FP8)
        return (q.float().double() @ self.w[0].float().double().T) * self.s_in.double() * self.s_w.double()

    def arms(self, m: int, cfg: configs.DecodeConfig | None) -> dict[str, list]:
        bf16 = torch.bfloat16
        c = range(self.copies)
        s_in, s_w = self.s_in, self.s_w
        rows, cols = self.rows_in[:m], self.cols_w
        w, x, xq = self.w, [t[:m] for t in self.x], [t[:m] for t in self.xq]

        def ours(i, cfg=cfg):
            return lambda: decode_gemm(x[i], w[i], s_w, s_in, None, bf16, config=cfg)

        return {
            "ours": [ours(i) for i in c],
            "ours_prequant": [lambda i=i: decode_gemm(xq[i], w[i], s_w, s_in, None, bf16, config=cfg) for i in c],
            "cublas+quant": [
                lambda i=i: torch._scaled_mm(quantize_fp8(x[i], s_in), w[i].t(), s_in, s_w, out_dtype=bf16) for i in c
            ],
            "cublas": [lambda i=i: torch._scaled_mm(xq[i], w[i].t(), s_in, s_w, out_dtype=bf16) for i in c],
            "rowwise+quant": [
                lambda i=i: torch._scaled_mm(quantize_fp8(x[i], s_in), w[i].t(), rows, cols, out_dtype=bf16) for i in c
            ],
        }


def run(args: argparse.Namespace, out: Path) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    fp = fingerprint()
    print(json.dumps(fp), flush=True)
    copy_gbs = copy_bandwidth_gbs()
    # What an empty kernel costs through the same timing: launch and event overhead, no work.
    empty_us = statistics.median(time_cold([lambda: torch.cuda._sleep(0)], repeats=50))
    empty_graph_us = statistics.median(time_graph([lambda: torch.cuda._sleep(0)] * 50, repeats=10))
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; empty kernel {empty_us:.2f} µs, in a graph {empty_graph_us:.2f} µs")
    ms = [int(v) for v in args.ms.split(",")]
    rows: list[dict] = []
    sweep_rows: list[dict] = []
    result = {
        "fingerprint": fp, "copy_gbs": copy_gbs, "empty_kernel_us": empty_us, "empty_kernel_graph_us": empty_graph_us,
        "command": " ".join(sys.argv),
        "rows": rows, "sweep": sweep_rows,
    }  # fmt: skip
    for name, (n, k) in SHAPES.items():
        if args.shapes and name not in args.shapes.split(","):
            continue
        ops = Operands(n, k, max(ms), gen)
        for m in ms:
            t0 = time.time()
            ref = ops.reference(m)
            heur = choose_config(m, n, k)
            best_cfg, best_us = None, float("inf")
            if args.sweep and m in {int(v) for v in args.sweep_ms.split(",")}:
                blocks = CUDA_CORE_BLOCKS
                if args.cuda_core_blocks:
                    blocks = tuple(tuple(int(v) for v in b.split("x")) for b in args.cuda_core_blocks.split(","))
                block_ms = tuple(int(v) for v in args.sweep_block_ms.split(",") if v)
                for cfg in sweep_configs(m, n, k, fp["sm_count"], args.sweep_kinds, blocks, block_ms):
                    try:
                        y = decode_gemm(ops.x[0][:m], ops.w[0], ops.s_w, ops.s_in, None, torch.bfloat16, config=cfg)
                        err = rel_err(y, ref)
                        calls = ops.arms(m, cfg)["ours"]
                        us = statistics.median(time_cold(calls, repeats=args.sweep_repeats, warmup=1))
                    except Exception as exc:  # e.g. out of shared memory: log it and go on
                        print(f"  {cfg} failed: {exc!r}"[:300], flush=True)
                        continue
                    sweep_rows.append({"shape": name, "n": n, "k": k, "m": m, **cfg.__dict__, "us": us, "rel_err": err})
                    if err < 2e-2 and us < best_us:
                        best_cfg, best_us = cfg, us
            arms = ops.arms(m, None)
            if best_cfg is not None:
                arms["ours_best"] = ops.arms(m, best_cfg)["ours"]
            errs = {}
            for arm, calls in arms.items():
                errs[arm] = rel_err(calls[0](), ref)
            timings = {"events": time_arms(arms, repeats=args.repeats)}
            if args.graph:
                timings["graph"] = time_arms(arms, repeats=args.graph_replays, timer=time_graph)
            nbytes = n * k + m * k * 2 + m * n * 2
            floor_us = nbytes / (copy_gbs * 1e3)
            for mode, timed in timings.items():
                for arm, t in timed.items():
                    rows.append({
                    "shape": name, "n": n, "k": k, "m": m, "arm": arm, "timing": mode,
                    "median_us": t.median_us, "rep_medians_us": list(t.rep_medians_us), "spread": t.spread,
                    "gbs": nbytes / (t.median_us * 1e3), "pct_copy_bw": 100 * floor_us / t.median_us,
                    "floor_us": floor_us, "rel_err": errs[arm],
                    "config": (best_cfg if arm == "ours_best" else heur).__dict__ if arm.startswith("ours") else None,
                    })  # fmt: skip
            timed = timings["events"]
            o, cq = timed["ours"].median_us, timed["cublas+quant"].median_us
            print(
                f"{name:12s} M={m:4d} ours {o:7.2f} cublas+q {cq:7.2f} cublas {timed['cublas'].median_us:7.2f} "
                f"rowwise+q {timed['rowwise+quant'].median_us:7.2f} floor {floor_us:6.2f} "
                + (f"best {best_us:7.2f} {best_cfg} " if best_cfg else "")
                + (
                    f"graph: ours {timings['graph']['ours'].median_us:7.2f} "
                    f"cublas+q {timings['graph']['cublas+quant'].median_us:7.2f} "
                    if "graph" in timings
                    else ""
                )
                + f"err ours {errs['ours']:.1e} cublas {errs['cublas']:.1e} [{time.time() - t0:.1f}s]",
                flush=True,
            )
        del ops
        torch.cuda.empty_cache()
        (out / "decode_bench.json").write_text(json.dumps(result, indent=1))  # a cut-off run keeps what it has
    return result


def timings_tie(a: dict, b: dict) -> bool:
    """Two arms tie when their gap is inside the larger rep-to-rep spread of the two."""
    gap = abs(a["median_us"] - b["median_us"]) / max(a["median_us"], b["median_us"])
    return gap <= max(a["spread"], b["spread"])


def summarize(result: dict) -> str:
    lines = [
        f"copy bandwidth {result['copy_gbs']:.0f} GB/s, empty kernel {result['empty_kernel_us']:.2f} µs"
        f" (in a graph {result.get('empty_kernel_graph_us', float('nan')):.2f} µs); cold L2 by rotation"
    ]
    for mode in ("events", "graph"):
        rows = [r for r in result["rows"] if r.get("timing", "events") == mode]
        if rows:
            lines.append(
                f"-- timing: {mode} "
                + ("(per call, 2 reps x 30)" if mode == "events" else "(per call, 2 reps x graph replays)")
            )
            lines += _summary_table(rows)
    return "\n".join(lines)


def _summary_table(rows: list[dict]) -> list[str]:
    by = {(r["shape"], r["m"], r["arm"]): r for r in rows}
    arms = sorted(
        {r["arm"] for r in rows},
        key=[
            "ours",
            "ours_prefetch_flipped",
            "ours_best",
            "ours_prequant",
            "cublas+quant",
            "cublas",
            "rowwise+quant",
        ].index,
    )
    lines = [
        f"{'shape':12s} {'M':>4s} "
        + " ".join(f"{a:>13s}" for a in arms)
        + f" {'floor':>7s} {'%bw ours':>8s} {'x vs cub+q':>10s}"
    ]
    for shape in SHAPES:
        for m in sorted({r["m"] for r in rows if r["shape"] == shape}):
            t = {a: by[(shape, m, a)]["median_us"] for a in arms if (shape, m, a) in by}
            lines.append(
                f"{shape:12s} {m:4d} "
                + " ".join(f"{t.get(a, float('nan')):13.2f}" for a in arms)
                + f" {by[(shape, m, 'ours')]['floor_us']:7.2f} {by[(shape, m, 'ours')]['pct_copy_bw']:7.1f}%"
                + f" {t['cublas+quant'] / t['ours']:9.2f}x"
                + (" tie" if timings_tie(by[(shape, m, "ours")], by[(shape, m, "cublas+quant")]) else "")
            )
    for m in (1, 16):
        tp1 = [s for s in SHAPES if s.startswith("tp1")]
        if not all((s, m, "ours") in by for s in tp1):
            continue
        sums = {a: sum(by[(s, m, a)]["median_us"] for s in tp1) for a in arms if all((s, m, a) in by for s in tp1)}
        floor = sum(by[(s, m, "ours")]["floor_us"] for s in tp1)
        lines.append(
            f"Llama-3.1-8B TP1 sum M={m}: "
            + ", ".join(f"{a} {v:.1f}" for a, v in sums.items())
            + f", floor {floor:.1f} µs; ours is {sums['cublas+quant'] / sums['ours']:.2f}x cublas+quant,"
            f" {sums['cublas'] / sums['ours']:.2f}x cublas GEMM-only"
        )
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("timing", "events") == "events"]
    fig, axes = plt.subplots(2, 4, figsize=(20, 9))
    for ax, (shape, (n, k)) in zip(axes.flat, SHAPES.items(), strict=False):
        for arm in sorted({r["arm"] for r in rows}):
            pts = sorted((r["m"], r["median_us"]) for r in rows if r["shape"] == shape and r["arm"] == arm)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=arm)
        fl = sorted((r["m"], r["floor_us"]) for r in rows if r["shape"] == shape and r["arm"] == "ours")
        if fl:
            ax.plot(*zip(*fl, strict=True), "k--", label="floor (bytes / copy bw)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape} N={n} K={k}")
        ax.set_xlabel("M")
        ax.set_ylabel("µs")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fp = result["fingerprint"]
    fig.suptitle(f"FP8 decode linears, {fp['gpu']}, torch {fp['torch']}, triton {fp['triton']}, cold L2 by rotation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for decode_bench.json/.png")
    ap.add_argument("--sweep", action="store_true", help="also time every candidate config of ours")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default="", help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--sweep-repeats", type=int, default=20)
    ap.add_argument("--graph", action="store_true", help="also time every arm inside a CUDA graph")
    ap.add_argument("--graph-replays", type=int, default=10, help="graph replays per rep (one sample each)")
    ap.add_argument("--sweep-kinds", default="wgmma", help="kernels to sweep: wgmma, cuda_core or both (comma)")
    ap.add_argument(
        "--cuda-core-blocks",
        default="",
        help="CUDA-core blocks to sweep, block_n x block_k x warps x stages [x maxnreg]: 16x512x4x1,16x2048x8x1x64",
    )
    ap.add_argument("--sweep-block-ms", default="", help="wgmma token tiles to sweep below M's own, e.g. 16,32")
    ap.add_argument("--sweep-ms", default=",".join(map(str, SWEEP_MS)), help="M values to sweep configs at")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args, out)
    try:
        plot(result, out / "decode_bench.png")
    except Exception as exc:  # a missing matplotlib must not cost the numbers
        print(f"plot failed: {exc!r}")
    print(summarize(result))


if __name__ == "__main__":
    main()
