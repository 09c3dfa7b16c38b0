"""Experiment: a stream-K partition for the CUDA-core decode kernel (M <= 8). Not in the library
until it has been measured to win.

Why: at M=1 fp8_gemv runs 2-5 µs over a kernel that only reads the same bytes
(results/h200/decode_limits/run1), and that pure read was fastest with one even share per CTA,
8-16 CTAs per SM. fp8_gemv's grid is row blocks x K splits: on gate_up (896 blocks of 32 rows,
62 registers per thread, 4 CTAs per SM) that is 1.7 waves, on qkv (384 blocks) 0.73 of one.
Here the grid is ctas_per_sm x SMs, and the row-block x K-step units are cut into equal contiguous
shares; a row block whose units straddle CTAs is summed from their partials by the last of them
to arrive, in CTA order (deterministic, counters reset for graph replay), as fp8_gemv's split-K does.

    PYTHONPATH=$PWD python3 benchmarks/exp_stream_k.py --check              # against the reference
    PYTHONPATH=$PWD python3 benchmarks/exp_stream_k.py --out DIR [--ms 1,2]  # sweep vs fp8_gemv's table
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_bench import SHAPES  # noqa: E402  (the eight Llama-3.1-8B TP1 and TP4 shapes)

from fp8route.bench.timing import copies_for, time_arms, time_cold  # noqa: E402
from fp8route.kernels import fp8_gemv as fg  # noqa: E402

FP8 = torch.float8_e4m3fn
BLOCKS = ((16, 512, 4), (32, 512, 8), (16, 1024, 8), (32, 512, 4))  # (block_n, block_k, num_warps)
CTAS_PER_SM = (2, 3, 4, 5, 6, 8)
# Register caps (0: none). Uncapped, 32x512 with 8 warps takes 73 registers (3 CTAs per SM); capped
# at 64 it compiles for sm_90 to 61 without spills (4 per SM), at 48 with 24-32 bytes of stack.
MAXNREG = (0, 64, 48)


@triton.jit
def _stream_k_kernel(
    x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, w_scale_ptr, in_scale_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, units, k_steps, grid, max_pieces,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, QUANT_X: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    u = pid * units // grid
    u_end = (pid + 1) * units // grid
    offs_r = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    in_scale = tl.load(in_scale_ptr)
    in_scale_rcp = tl.math.div_rn(1.0, in_scale)
    scale = in_scale * tl.load(w_scale_ptr)
    while u < u_end:
        rb = u // k_steps
        seg_end = tl.minimum(u_end, (rb + 1) * k_steps)
        offs_n = rb * BLOCK_N + offs_r
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for ks in range(u - rb * k_steps, seg_end - rb * k_steps):
            k = ks * BLOCK_K + offs_k
            k_mask = k < K
            w = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0
            )
            w = w.to(tl.float32)
            for i in tl.static_range(BLOCK_M):
                xt = tl.load(x_ptr + i * stride_xm + k, mask=k_mask & (i < M), other=0.0)
                if QUANT_X:
                    xt = fg._quantize(xt, in_scale, in_scale_rcp)
                part = tl.sum(w * xt.to(tl.float32)[None, :], axis=1)
                acc += tl.where(offs_m[None, :] == i, part[:, None], 0.0)
        # The CTAs whose shares hold units of this row block: cta_of(u) = ((u + 1) * grid - 1) // units.
        first = ((rb * k_steps + 1) * grid - 1) // units
        last = (((rb + 1) * k_steps) * grid - 1) // units
        if first == last:
            fg._store_out(acc, out_ptr, out_ptr, scale, offs_n, offs_m, n_mask, m_mask, stride_om, False)
        else:
            tile = BLOCK_N * BLOCK_M
            slot_offs = offs_r[:, None] * BLOCK_M + offs_m[None, :]
            tl.store(ws_ptr + (rb * max_pieces + pid - first) * tile + slot_offs, acc)
            tl.debug_barrier()  # every thread's partial written before the counter releases it
            arrived = tl.atomic_add(cnt_ptr + rb, 1, sem="acq_rel", scope="gpu")
            if arrived == last - first:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for piece in range(0, last - first + 1):  # in CTA order: the bits never depend on timing
                    total += tl.load(ws_ptr + (rb * max_pieces + piece) * tile + slot_offs, cache_modifier=".cg")
                fg._store_out(total, out_ptr, out_ptr, scale, offs_n, offs_m, n_mask, m_mask, stride_om, False)
                tl.atomic_xchg(cnt_ptr + rb, 0)
        u = seg_end


_COUNTERS: dict[tuple, torch.Tensor] = {}


def stream_k(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, in_scale: torch.Tensor, out_dtype: torch.dtype,
    *, block_n: int, block_k: int, warps: int, grid: int, maxnreg: int = 0, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    m, k = x.shape
    n = w.shape[0]
    block_m = max(1, triton.next_power_of_2(m))
    assert block_m <= fg.CUDA_CORE_M_MAX, "the CUDA-core kernel takes at most 8 tokens"
    row_blocks, k_steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    units = row_blocks * k_steps
    grid = min(grid, units)
    max_pieces = triton.cdiv(k_steps, units // grid) + 1
    key = (x.device, row_blocks)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(row_blocks, dtype=torch.int32, device=x.device)
    ws = torch.empty(row_blocks * max_pieces * block_n * block_m, dtype=torch.float32, device=x.device)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device) if out is None else out
    _stream_k_kernel[(grid,)](
        x, w, out, ws, _COUNTERS[key], w_scale, in_scale,
        m, n, k, x.stride(0), w.stride(0), out.stride(0), units, k_steps, grid, max_pieces,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=block_m, QUANT_X=x.dtype != FP8, num_warps=warps,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
    return out


def reference(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, in_scale: torch.Tensor) -> torch.Tensor:
    xq = x if x.dtype == FP8 else (x.float() / in_scale).clamp(-448, 448).to(FP8)
    return (xq.float() @ w.float().t()) * in_scale * w_scale


def check(device: str) -> int:
    """Every block shape and several grids against the reference, NaN-prefilled outputs, repeat
    runs bit-identical. Returns the number of failures (0: all passed)."""
    gen = torch.Generator(device=device).manual_seed(0)
    on_cpu = device == "cpu"  # Triton's interpreter (TRITON_INTERPRET=1): slow, so small cases
    cases = [(256, 1024), (200, 1040)] if on_cpu else list(SHAPES.values())
    failures = 0
    for n, k in cases:
        w = (torch.randn(n, k, device=device, generator=gen) * 100).clamp(-448, 448).to(FP8)
        w_scale, in_scale = torch.tensor(0.01, device=device), torch.tensor(4 / 448, device=device)
        for m in (1, 3) if on_cpu else (1, 2, 3, 8):
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            if on_cpu:  # the interpreter converts to e4m3 exactly only from small integers: x given in e4m3
                w = torch.randint(-4, 5, (n, k), generator=gen, device=device).float().to(FP8)
                x = torch.randint(-4, 5, (m, k), generator=gen, device=device).float().to(FP8)
            ref = reference(x, w, w_scale, in_scale)
            for block_n, block_k, warps in BLOCKS:
                for grid in (3, 7, 64) if on_cpu else (3, 7, 64, 1000):
                    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
                    got = stream_k(x, w, w_scale, in_scale, torch.bfloat16, block_n=block_n, block_k=block_k,
                                   warps=warps, grid=grid, out=out).float()  # fmt: skip
                    again = stream_k(x, w, w_scale, in_scale, torch.bfloat16, block_n=block_n, block_k=block_k,
                                     warps=warps, grid=grid)  # fmt: skip
                    err = ((got - ref).norm() / ref.norm()).item()
                    ok = err < 5e-3 and not got.isnan().any() and torch.equal(got.bfloat16(), again)
                    if not ok:
                        failures += 1
                        print(f"FAIL {n}x{k} M={m} {block_n}x{block_k}x{warps}w grid {grid}: error {err:.1e}")
        print(f"checked {n}x{k}", flush=True)
    print(f"check: {failures} failures")
    return failures


def sweep(out_dir: Path, ms: list[int]) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_scale, in_scale = torch.tensor(0.01, device="cuda"), torch.tensor(4 / 448, device="cuda")
    rows = []
    for name, (n, k) in SHAPES.items():
        base = (torch.randn(n, k, device="cuda", generator=gen) * 100).clamp(-448, 448).to(FP8)
        weights = [base.clone() for _ in range(copies_for(n * k))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            table = [lambda w=w, x=x: fg.fp8_gemv(x, w, w_scale, in_scale, None, torch.bfloat16) for w in weights]
            screened = []
            for block_n, block_k, warps in BLOCKS:
                for per_sm, maxnreg in itertools.product(CTAS_PER_SM, MAXNREG):
                    cfg = dict(block_n=block_n, block_k=block_k, warps=warps, grid=per_sm * sms, maxnreg=maxnreg)
                    calls = [lambda w=w, x=x, cfg=cfg: stream_k(x, w, w_scale, in_scale, torch.bfloat16, **cfg)
                             for w in weights]  # fmt: skip
                    screened.append((statistics.median(time_cold(calls, repeats=20, warmup=1)), cfg, calls))
            screened.sort(key=lambda s: s[0])
            arms = {"fp8_gemv": table}
            arms.update({f"sk {c['block_n']}x{c['block_k']}x{c['warps']}w g{c['grid']} r{c['maxnreg']}": calls
                         for _, c, calls in screened[:3]})  # fmt: skip
            timed = time_arms(arms, repeats=30)
            base_us = timed["fp8_gemv"].median_us
            for arm, t in timed.items():
                rows.append({"shape": name, "n": n, "k": k, "m": m, "arm": arm, "median_us": t.median_us,
                             "spread": t.spread, "vs_fp8_gemv": base_us / t.median_us})  # fmt: skip
                print(f"{name:12s} M={m}  {arm:28s} {t.median_us:7.2f} µs (spread {100 * t.spread:.1f}%)"
                      f"  fp8_gemv / this {base_us / t.median_us:.3f}", flush=True)  # fmt: skip
        del weights
        torch.cuda.empty_cache()
    (out_dir / "stream_k.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ms", default="1,2")
    args = ap.parse_args()
    if args.check:
        sys.exit(1 if check("cuda" if torch.cuda.is_available() else "cpu") else 0)
    assert args.out is not None, "--out DIR (or --check)"
    args.out.mkdir(parents=True, exist_ok=True)
    sweep(args.out, [int(v) for v in args.ms.split(",")])


if __name__ == "__main__":
    main()
