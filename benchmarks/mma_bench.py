"""The wgmma decode kernel (fp8route/kernels/fp8_mma.py) on one GPU: checks, a config sweep, and a
comparison with our Triton kernel and cuBLASLt, all timed with fp8route.bench.timing (cold L2 by
rotating copies, interleaved arms twice; per call and inside a CUDA graph).

    PYTHONUNBUFFERED=1 python benchmarks/mma_bench.py --out DIR [--sections check,sweep,compare]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_bench import SHAPES, Operands, fingerprint, rel_err  # noqa: E402

from fp8route.bench.timing import copy_bandwidth_gbs, time_arms, time_cold, time_graph  # noqa: E402
from fp8route.kernels import fp8_gemv as fg  # noqa: E402
from fp8route.kernels import fp8_mma as fm  # noqa: E402

FP8 = torch.float8_e4m3fn
MS = (1, 2, 4, 8, 16, 32, 64)
MAX_REGS_EST = 176  # weight buffers + accumulators per thread, in 32-bit registers; above it ptxas spills


def candidate_configs(m: int, n: int, k: int, num_sms: int) -> list[fm.MmaConfig]:
    nt = -(-m // 8)
    out = []
    for rg, wgs, unroll in itertools.product((1, 2), (1, 2), (2, 4, 8)):
        if 16 * unroll * rg + 8 * rg * nt > MAX_REGS_EST:
            continue
        chunks, tiles = k // fm.CHUNK, -(-n // (64 * rg * wgs))
        for split in (1, 2, 3, 4, 6, 8, 12, 16):
            per = -(-chunks // split)
            if per < unroll or fm.smem_bytes(m, per) > 200 * 1024:
                continue
            if split > 1 and not num_sms // 2 <= tiles * split <= 16 * num_sms:
                continue
            out.append(fm.MmaConfig(rg, wgs, unroll, split))
    return out


def precompile(configs: set[tuple[int, fm.MmaConfig, int, bool, bool]]) -> float:
    def compile_one(c: tuple) -> None:
        torch.cuda.synchronize()  # makes the device's context current in this worker thread
        fm._kernel(*c, 0)

    t0 = time.time()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(compile_one, sorted(configs, key=str)))
    return time.time() - t0


def check(out: Path) -> list[dict]:
    """Numerics against an fp64 reference of the same quantized operands, the fused quantizer against
    the standalone one (bit for bit), NaN-prefilled outputs, repeat and graph-replay bits."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    cases = [(1536, 4096), (4096, 1024), (4096, 3584), (1000, 1024), (7168, 4096)]
    for (n, k), m in itertools.product(cases, (1, 2, 3, 5, 8, 9, 16, 17, 31, 32, 33, 48, 63, 64)):
        w = (torch.randn(n, k, device="cuda", generator=gen) * 150).clamp(-448, 448).to(FP8)
        x = (torch.randn(m, k, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        s_in, s_w = torch.tensor(4.0 / 448, device="cuda"), torch.tensor(1.0 / 448, device="cuda")
        bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
        xq = fg.quantize_fp8(x, s_in)
        ref = (xq.double() @ w.double().T) * s_in.double() * s_w.double() + bias.double()
        for cfg in {fm.default_config(m, n, k, 132), fm.MmaConfig(1, 1, 4, 1), fm.MmaConfig(2, 2, 2, 3)}:
            if fm.smem_bytes(m, -(-(k // fm.CHUNK) // cfg.split_k)) > fm._SMEM_MAX:
                continue
            y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            fm.fp8_mma(x, w, s_w, s_in, bias, torch.bfloat16, out=y, config=cfg)
            y_pre = fm.fp8_mma(xq, w, s_w, s_in, bias, torch.bfloat16, config=cfg)
            y_again = fm.fp8_mma(x, w, s_w, s_in, bias, torch.bfloat16, config=cfg)
            row = {
                "n": n, "k": k, "m": m, "config": cfg.__dict__, "rel_err": rel_err(y, ref),
                "finite": bool(torch.isfinite(y).all()), "fused_equals_prequant": bool(torch.equal(y, y_pre)),
                "repeat_equal": bool(torch.equal(y, y_again)),
            }  # fmt: skip
            row["ok"] = row["rel_err"] < 5e-3 and row["finite"] and row["fused_equals_prequant"] and row["repeat_equal"]
            rows.append(row)
            if not row["ok"]:
                print("CHECK FAILED", row, flush=True)
    # fp16 in and out, no bias; graph replay
    n, k, m = 4096, 3584, 24
    w = (torch.randn(n, k, device="cuda", generator=gen) * 150).clamp(-448, 448).to(FP8)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.float16)
    s_in, s_w = torch.tensor(4.0 / 448, device="cuda"), torch.tensor(1.0 / 448, device="cuda")
    xq = fg.quantize_fp8(x, s_in)
    ref = (xq.double() @ w.double().T) * s_in.double() * s_w.double()
    cfg = fm.MmaConfig(1, 2, 2, 4)
    y = fm.fp8_mma(x, w, s_w, s_in, None, torch.float16, config=cfg)
    yg = torch.empty_like(y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fm.launch(x, w, s_w, s_in, None, torch.float16, out=yg, config=cfg)
    for _ in range(3):
        yg.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    row = {"n": n, "k": k, "m": m, "fp16": True, "rel_err": rel_err(y, ref), "graph_equal": bool(torch.equal(y, yg))}
    row["ok"] = row["rel_err"] < 5e-3 and row["graph_equal"]
    rows.append(row)
    bad = [r for r in rows if not r["ok"]]
    worst = max(r["rel_err"] for r in rows)
    print(f"check: {len(rows) - len(bad)}/{len(rows)} ok, worst rel err {worst:.2e}", flush=True)
    (out / "check.json").write_text(json.dumps(rows, indent=1))
    return rows


def host_us_per_call(fn, calls: int = 300) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / calls * 1e6


def arms_for(ops: Operands, m: int, cfg: fm.MmaConfig) -> dict[str, list]:
    bf16, s_in, s_w, c = torch.bfloat16, ops.s_in, ops.s_w, range(ops.copies)
    x, xq, w = [t[:m] for t in ops.x], [t[:m] for t in ops.xq], ops.w
    return {
        "mma": [lambda i=i: fm.launch(x[i], w[i], s_w, s_in, None, bf16, config=cfg) for i in c],
        "mma_prequant": [lambda i=i: fm.launch(xq[i], w[i], s_w, s_in, None, bf16, config=cfg) for i in c],
        "triton": [lambda i=i: fg.launch(x[i], w[i], s_w, s_in, None, bf16) for i in c],
        "cublas+quant": [
            lambda i=i: torch._scaled_mm(fg.quantize_fp8(x[i], s_in), w[i].t(), s_in, s_w, out_dtype=bf16) for i in c
        ],
        "cublas": [lambda i=i: torch._scaled_mm(xq[i], w[i].t(), s_in, s_w, out_dtype=bf16) for i in c],
    }


def measure_point(
    name: str, ops: Operands, m: int, args: argparse.Namespace, sections: list[str], num_sms: int,
    copy_gbs: float, result: dict,
) -> None:  # fmt: skip
    """Sweep the configs at one (shape, M), then time the best against the other kernels."""
    t0 = time.time()
    n, k = ops.n, ops.k
    ref = ops.reference(m)
    best, best_us = fm.default_config(m, n, k, num_sms), float("inf")
    for cfg in candidate_configs(m, n, k, num_sms) if "sweep" in sections else ():
        calls = arms_for(ops, m, cfg)["mma"]
        err = rel_err(calls[0](), ref)
        us = statistics.median(time_cold(calls, repeats=args.sweep_repeats, warmup=1))
        result["sweep"].append({"shape": name, "n": n, "k": k, "m": m, **cfg.__dict__, "us": us, "rel_err": err})
        if err < 5e-3 and us < best_us:
            best, best_us = cfg, us
    arms = arms_for(ops, m, best)
    errs = {arm: rel_err(calls[0](), ref) for arm, calls in arms.items()}
    timings = {"events": time_arms(arms, repeats=args.repeats)}
    if args.graph:
        timings["graph"] = time_arms(arms, repeats=args.graph_replays, timer=time_graph)
    floor_us = (n * k + m * k * 2 + m * n * 2) / (copy_gbs * 1e3)
    for mode, timed in timings.items():
        for arm, t in timed.items():
            result["rows"].append({
                "shape": name, "n": n, "k": k, "m": m, "arm": arm, "timing": mode, "median_us": t.median_us,
                "rep_medians_us": list(t.rep_medians_us), "spread": t.spread, "floor_us": floor_us,
                "pct_copy_bw": 100 * floor_us / t.median_us, "rel_err": errs[arm],
                "config": best.__dict__ if arm.startswith("mma") else None,
            })  # fmt: skip
    line = " ".join(f"{a} {t.median_us:6.2f}" for a, t in timings["events"].items())
    if "graph" in timings:
        gr = timings["graph"]
        line += f" | graph mma {gr['mma'].median_us:6.2f} cublas+q {gr['cublas+quant'].median_us:6.2f}"
        line += f" triton {gr['triton'].median_us:6.2f}"
    print(f"{name:12s} M={m:3d} {line} floor {floor_us:5.2f} {best} [{time.time() - t0:.1f}s]", flush=True)


def run(args: argparse.Namespace, out: Path) -> dict:
    fp = fingerprint()
    num_sms = fp["sm_count"]
    print(json.dumps(fp), flush=True)
    result: dict = {"fingerprint": fp, "command": " ".join(sys.argv), "sweep": [], "rows": []}
    sections = args.sections.split(",")
    if "check" in sections:
        rows = check(out)
        result["check_ok"] = all(r["ok"] for r in rows)
    if not {"sweep", "compare"} & set(sections):
        return result
    result["copy_gbs"] = copy_gbs = copy_bandwidth_gbs()
    ms = [int(v) for v in args.ms.split(",")]
    shapes = args.shapes.split(",") if args.shapes else list(SHAPES)
    todo = {
        (-(-m // 8), c, 0, True, False) for s in shapes for m in ms for c in candidate_configs(m, *SHAPES[s], num_sms)
    }
    print(f"precompiled {len(todo)} kernels in {precompile(todo):.1f} s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in shapes:
        ops = Operands(*SHAPES[name], max(ms), gen)
        for m in ms:
            measure_point(name, ops, m, args, sections, num_sms, copy_gbs, result)
        del ops
        torch.cuda.empty_cache()
        (out / "mma_bench.json").write_text(json.dumps(result, indent=1))
    bf16 = torch.bfloat16
    w = torch.empty(1536, 1024, device="cuda").to(FP8)
    x = torch.randn(1, 1024, device="cuda", dtype=bf16)
    s = torch.tensor(1.0, device="cuda")
    result["host_us_per_call"] = {
        "mma": host_us_per_call(lambda: fm.launch(x, w, s, s, None, bf16)),
        "triton": host_us_per_call(lambda: fg.launch(x, w, s, s, None, bf16)),
        "cublas+quant": host_us_per_call(lambda: torch._scaled_mm(fg.quantize_fp8(x, s), w.t(), s, s, out_dtype=bf16)),
    }
    print("host µs per call:", {a: round(v, 1) for a, v in result["host_us_per_call"].items()}, flush=True)
    return result


def summarize(result: dict) -> str:
    lines = ["shape         M  timing  mma    triton  cublas+q  mma/cublas+q  mma %copybw"]
    by = {}
    for r in result["rows"]:
        by.setdefault((r["shape"], r["m"], r["timing"]), {})[r["arm"]] = r
    for (shape, m, timing), arms in by.items():
        mma, cq = arms["mma"]["median_us"], arms["cublas+quant"]["median_us"]
        lines.append(
            f"{shape:12s} {m:3d} {timing:6s} {mma:6.2f} {arms['triton']['median_us']:6.2f} {cq:8.2f} "
            f"{cq / mma:10.2f}x {arms['mma']['pct_copy_bw']:8.0f}%"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sections", default="check,sweep,compare")
    ap.add_argument("--shapes", default="", help="comma-separated names from decode_bench.SHAPES (default all)")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--sweep-repeats", type=int, default=10)
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--graph-replays", type=int, default=10)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args, args.out)
    (args.out / "mma_bench.json").write_text(json.dumps(result, indent=1))
    if result["rows"]:
        table = summarize(result)
        (args.out / "summary.txt").write_text(table + "\n")
        print(table)


if __name__ == "__main__":
    main()
