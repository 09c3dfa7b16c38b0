"""Experiment: at M 16..64, tokens on the wgmma's A side, quantized in registers.

With the weight on A (fp8_gemv's wgmma kernel), the quantized x must be written to shared memory
every K-step, and Triton then waits for each wgmma before the next (warp_group_dot_wait
pendings=0): no MMA overlaps the next step. With x quantized into registers as A (64 token rows,
padded), the weight tile comes from shared memory as B and the wgmmas stay in flight.
ACC 0: the tensor cores' own accumulation over the whole split (fast accumulation; Triton drops
the every-128 promotion when A is in registers); ACC 1: each BLOCK_K step into a fresh accumulator,
added in fp32 (promotion every BLOCK_K, as fp8_gemv).

    PYTHONPATH=$PWD python3 benchmarks/exp_tokens_a.py --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8route.bench.timing import copies_for, time_arms, time_cold, time_graph  # noqa: E402
from fp8route.kernels import fp8_gemv as fg  # noqa: E402
from fp8route.kernels.fp8_gemv import _finish, _quantize  # noqa: E402

FP8 = torch.float8_e4m3fn
bf16 = torch.bfloat16
SHAPES = {"tp4_qkv": (1536, 4096), "tp4_o": (4096, 1024), "tp4_gate_up": (7168, 4096), "tp4_down": (4096, 3584),
          "tp1_qkv": (6144, 4096), "tp1_down": (4096, 14336)}  # fmt: skip


@triton.jit(do_not_specialize=["M", "split_k"])
def _tokens_a_kernel(
    x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, w_scale_ptr, in_scale_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, split_k, k_per_split,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, ACC: tl.constexpr, USE_WS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_k = pid % split_k
    pid_n = pid // split_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_lo = pid_k * k_per_split
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + (k_lo + offs_k)[:, None]  # W^T tile [BLOCK_K, BLOCK_N]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]  # x tile [BLOCK_M, BLOCK_K]
    in_scale = tl.load(in_scale_ptr)
    rcp = tl.math.div_rn(1.0, in_scale)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        wt = tl.load(w_ptrs)
        xq = _quantize(tl.load(x_ptrs, mask=m_mask[:, None], other=0.0), in_scale, rcp)
        if ACC == 0:
            acc = tl.dot(xq, wt, acc)
        else:
            acc += tl.dot(xq, wt)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    _finish(tl.trans(acc), out_ptr, out_ptr, ws_ptr, cnt_ptr, in_scale * tl.load(w_scale_ptr), pid_k, pid_n, split_k,
            M, N, stride_om, offs_n, offs_m, n_mask, m_mask, False, USE_WS, 8)  # fmt: skip


def tokens_a(x, w, s_w, s_in, block_n, block_k, split, warps, stages, acc):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    k_per_split = k // split
    tiles = triton.cdiv(n, block_n)
    use_ws = split > 1
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if use_ws else out
    cnt = fg._counters(x.device, tiles) if use_ws else out
    _tokens_a_kernel[(tiles * split,)](
        x, w, out, ws, cnt, s_w, s_in, m, n, k, x.stride(0), w.stride(0), out.stride(0), split, k_per_split,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=64, ACC=acc, USE_WS=use_ws, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def cublas_quant(x, w, s_w, s_in):
    return torch._scaled_mm(fg.quantize_fp8(x, s_in), w.t(), s_in, s_w, out_dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", default="16,32,64")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    s_in = torch.tensor(4.0 / 448, device="cuda")
    s_w = torch.tensor(1.0 / 448, device="cuda")
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = copies_for(n * k)
        ws = [(torch.randn(n, k, device="cuda", generator=gen) * 150).clamp(-448, 448).to(FP8) for _ in range(copies)]
        xs = [torch.randn(64, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(copies)]
        for m in (int(v) for v in args.ms.split(",")):
            q = (xs[0][:m].float() / s_in).clamp(-448, 448).to(FP8)
            ref = (q.double() @ ws[0].double().T) * s_in.double() * s_w.double()
            screened = []
            for bn, bk, warps, stages, acc in itertools.product((64, 128, 256), (128, 256), (4, 8), (4,), (0, 1)):
                for split in (1, 2, 4, 8, 16):
                    if k % (split * bk) or not 66 <= triton.cdiv(n, bn) * split <= 528 and split > 1:
                        continue
                    cfg = (bn, bk, split, warps, stages, acc)
                    try:
                        y = tokens_a(xs[0][:m], ws[0], s_w, s_in, *cfg)
                        err = ((y.double() - ref).norm() / ref.norm()).item()
                        calls = [partial(tokens_a, xs[i][:m], ws[i], s_w, s_in, *cfg) for i in range(copies)]
                        us = statistics.median(time_cold(calls, repeats=10, warmup=1))
                    except Exception as exc:  # out of shared memory / registers: skip the config
                        print(f"  {cfg} failed: {type(exc).__name__}", flush=True)
                        continue
                    screened.append((us, err, cfg))
            screened.sort()
            err_cublas = ((cublas_quant(xs[0][:m], ws[0], s_w, s_in).double() - ref).norm() / ref.norm()).item()
            best = {acc: next((s for s in screened if s[2][5] == acc and s[1] < 1e-2), None) for acc in (0, 1)}
            arms = {
                "ours": [partial(fg.fp8_gemv, xs[i][:m], ws[i], s_w, s_in, None, bf16) for i in range(copies)],
                "cublas+quant": [
                    partial(cublas_quant, xs[i][:m], ws[i], s_w, s_in)
                    for i in range(copies)
                ],
            }  # fmt: skip
            for acc, b in best.items():
                if b is not None:
                    arms[f"tokens_a_acc{acc}"] = [
                        partial(tokens_a, xs[i][:m], ws[i], s_w, s_in, *b[2]) for i in range(copies)
                    ]
            line = f"{name:12s} M={m:3d}"
            for mode, timer in (("events", time_cold), ("graph", time_graph)):
                timed = time_arms(arms, repeats=30 if mode == "events" else 10, timer=timer)
                for arm, t in timed.items():
                    pick = best[int(arm[-1])] if arm.startswith("tokens") else None
                    rows.append({"shape": name, "m": m, "arm": arm, "timing": mode, "median_us": t.median_us,
                                 "spread": t.spread, "best": pick})  # fmt: skip
                line += f" | {mode}: " + " ".join(f"{a} {t.median_us:6.2f}" for a, t in timed.items())
            picks = [(b[2], f"{b[1]:.1e}") for b in best.values() if b]
            print(line + f" | best {picks} err cublas {err_cublas:.1e}", flush=True)
            (args.out / "tokens_a.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
