"""A serving step's prefill attention on Llama-3.1-8B's heads (32 query, 8 KV, head 128, bf16): one
SDPA call per chunk (the engine's path: cuDNN, lengths padded to a class) against one varlen call for
every chunk of the step (torch.nn.attention.varlen, FlashAttention-2), each checked against a float32
reference first. Per case: the GPU time of a layer's attention (events around 20 back-to-back calls,
behind a sleep kernel so the host stays ahead) and the host time to issue it (the same calls issued
while the GPU is busy).

    python3 benchmarks/prefill_attention.py [--cases 4096 2048,3072,3072 1024x8 ...]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from fp8route.engine.attention import _causal_self_attention

H, HKV, D = 32, 8, 128
BF16 = torch.bfloat16


def parse_case(text: str) -> list[int]:
    """'2048,3072' or '1024x8' -> chunk lengths."""
    out = []
    for part in text.split(","):
        length, _, count = part.partition("x")
        out += [int(length)] * int(count or 1)
    return out


def per_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """q [N, H, D], k/v [N, HKV, D] -> [N, H, D], one SDPA call per chunk as the engine makes them."""
    out = torch.empty_like(q)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        o = _causal_self_attention(*(x[part].transpose(0, 1)[None] for x in (q, k, v)))
        out[part] = o[0].transpose(0, 1)
        start += n
    return out


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if "enable_gqa" in params:
        return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0), enable_gqa=True)
    k, v = (x.repeat_interleave(H // HKV, dim=1) for x in (k, v))
    if "is_causal" in params:
        return varlen_attn(q, k, v, cu, cu, longest, longest, is_causal=True)
    return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    out, start = [], 0
    for n in lengths:
        part = slice(start, start + n)
        qi, ki, vi = (x[part].transpose(0, 1)[None].float() for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        start += n
    return torch.cat(out)


def gpu_and_host_us(fn: Callable[[], object], calls: int = 20) -> tuple[float, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)  # ~0.1 s: the host issues every call before the GPU reaches them
    begin.record()
    host = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - host
    end.record()
    torch.cuda.synchronize()
    gpu_ms = begin.elapsed_time(end)
    return 1e3 * gpu_ms / calls, 1e6 * host / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    cases = ["4096", "2048", "2048,3072,3072", "1024x8", "4096,4096", "512x16"]
    parser.add_argument("--cases", nargs="+", default=cases)
    args = parser.parse_args()
    from torch.nn.attention.varlen import varlen_attn

    print(f"torch {torch.__version__}; varlen_attn{inspect.signature(varlen_attn)}")
    rows = []
    for case in args.cases:
        lengths = parse_case(case)
        n = sum(lengths)
        torch.manual_seed(0)
        q, k, v = (torch.randn(n, h, D, device="cuda", dtype=BF16) for h in (H, HKV, HKV))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        ref = reference(q, k, v, lengths)
        scale = ref.abs().max().item()
        arms = {
            "per-chunk SDPA": partial(per_chunk, q, k, v, lengths),
            "varlen": partial(varlen, q, k, v, cu, max(lengths)),
        }
        cells = []
        for name, fn in arms.items():
            err = (fn().float() - ref).abs().max().item() / scale
            times = [gpu_and_host_us(fn) for _ in range(3)]
            gpu = statistics.median(t[0] for t in times)
            host = statistics.median(t[1] for t in times)
            cells.append((name, gpu, host, err))
        base = cells[0][1]
        row = f"{case:<16} {n:>6} tok  " + "  ".join(
            f"{name}: gpu {gpu:8.1f} us host {host:7.1f} us err {err:.1e} ({base / gpu:4.2f}x)"
            for name, gpu, host, err in cells
        )
        rows.append(row)
        print(row, flush=True)
    legend = "case, tokens, per arm: GPU us per layer call, host us to issue it, max err / max |ref|, vs per-chunk"
    print("\n".join(["", legend, *rows]))


if __name__ == "__main__":
    main()
