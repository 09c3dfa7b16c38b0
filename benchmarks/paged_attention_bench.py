"""The flat-batch paged attention (fp8route.kernels.paged_attention) against what the engine ran before
it, on Llama-3.1-8B's heads (32 query, 8 KV, head 128, bf16; blocks of 16), each checked against the
torch path first:

- decode: B rows at one context: RoPE + cache write + paged_attention's split-KV grid, against the
  decode kernel with the new token fused (fp8route.kernels.paged_decode), inside one CUDA graph over
  --layers layer pools (L2 holds none); GB/s of the KV read against the copy bandwidth;
- prefill: one fresh chunk of T tokens from the cache, against SDPA (cuDNN) over the chunk's own
  q/k/v as the engine ran fresh chunks; TFLOP/s of the causal products (4 * T^2 / 2 * H * D);
- mixed: 255 decode rows at 1024 and one fresh 2048 chunk, one call, against decode kernel + SDPA.

    python3 benchmarks/paged_attention_bench.py [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
import torch.nn.functional as F
import triton

from fp8route.kernels import paged_attention as pa
from fp8route.kernels import paged_decode as pd
from fp8route.kernels.fused import rope_into_cache
from fp8route.routing.fingerprint import Fingerprint
from fp8route.tuning.timing import time_graph

H, HKV, D, PAGE = 32, 8, 128, 16
BF16 = torch.bfloat16


def pools(rows: int, reach: int, layers: int, dtype: torch.dtype) -> tuple[list[pa.PagedKV], torch.Tensor]:
    per_row = -(-reach // PAGE)
    tables = (1 + torch.arange(rows * per_row, dtype=torch.int32, device="cuda")).view(rows, per_row)
    shape = (1 + rows * per_row, PAGE, HKV, D)

    def pool() -> pa.PagedKV:
        k, v = (torch.randn(shape, device="cuda").to(dtype) for _ in range(2))
        return pa.PagedKV(k, v, tables, *((0.05, 0.05) if dtype == torch.float8_e4m3fn else (1.0, 1.0)))

    return [pool() for _ in range(layers)], tables


def seqs_for(queries: list[int], lengths: list[int], singles: int) -> pa.Sequences:
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return pa.Sequences(cu, torch.tensor(lengths, dtype=torch.int32, device="cuda"),
                        torch.arange(len(lengths), device="cuda"), singles)  # fmt: skip


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 2e-2, f"{what}: relative error {err:.2e} against the torch path"


def decode(batch: int, ctx: int, layers: int, cache_dtype: torch.dtype) -> tuple[float, float, float]:
    caches, _ = pools(batch, ctx, layers, cache_dtype)
    q = torch.randn(batch, H, D, device="cuda", dtype=BF16)
    k_new, v_new = (torch.randn(batch, 1, HKV, D, device="cuda", dtype=BF16) for _ in range(2))
    cos, sin = torch.ones(batch, 1, D, device="cuda"), torch.zeros(batch, 1, D, device="cuda")
    seqs = seqs_for([1] * batch, [ctx] * batch, batch)
    rows, lengths = seqs.rows, seqs.lengths.long()
    slots = caches[0].tables[rows, (ctx - 1) // PAGE].long() * PAGE + (ctx - 1) % PAGE
    check(pa.paged_attention(q, caches[0], seqs), pa.paged_attention_reference(q, caches[0], seqs), "decode")

    def ours(c: pa.PagedKV) -> None:
        flat = [x.view(-1, HKV, D) for x in (c.k, c.v)]
        rope_into_cache(k_new, v_new, cos, sin, *flat, slots, None if c.k_scale == 1.0 else (c.k_scale, c.v_scale))
        pa.paged_attention(q, c, seqs)

    def before(c: pa.PagedKV) -> None:
        pages = pd.Pages(c.k, c.v, c.tables, rows, c.k_scale, c.v_scale)
        pd.decode_attention(q, pages, lengths, new=pd.NewToken(k_new[:, 0], v_new[:, 0], cos[:, 0], sin[:, 0]))

    new = statistics.median(time_graph([lambda c=c: ours(c) for c in caches], repeats=20))
    old = statistics.median(time_graph([lambda c=c: before(c) for c in caches], repeats=20))
    kv_bytes = 2 * batch * ctx * HKV * D * cache_dtype.itemsize
    return new, old, kv_bytes / (new * 1e-6) / 1e12


def prefill(tokens: int) -> tuple[float, float, float]:
    (cache,), _ = pools(1, tokens, 1, BF16)
    q = torch.randn(tokens, H, D, device="cuda", dtype=BF16)
    seqs = seqs_for([tokens], [tokens], 0)
    k, v = (x[cache.tables[0].long()].flatten(0, 1)[:tokens].transpose(0, 1)[None] for x in (cache.k, cache.v))
    q4 = q.transpose(0, 1)[None]
    sdpa = F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True)
    check(pa.paged_attention(q, cache, seqs), sdpa[0].transpose(0, 1), "prefill")
    new = triton.testing.do_bench(lambda: pa.paged_attention(q, cache, seqs), return_mode="median") * 1e3
    old = (
        triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True), return_mode="median"
        )
        * 1e3
    )
    return new, old, 2 * tokens * tokens * H * D / (new * 1e-6) / 1e12


def mixed() -> tuple[float, float]:
    decodes, ctx, chunk = 255, 1024, 2048
    caches, _ = pools(decodes + 1, max(ctx, chunk), 1, BF16)
    cache = caches[0]
    q = torch.randn(decodes + chunk, H, D, device="cuda", dtype=BF16)
    seqs = seqs_for([1] * decodes + [chunk], [ctx] * decodes + [chunk], decodes)
    check(pa.paged_attention(q, cache, seqs), pa.paged_attention_reference(q, cache, seqs), "mixed")
    rows, lengths = seqs.rows[:decodes], seqs.lengths[:decodes].long()
    pages = pd.Pages(cache.k, cache.v, cache.tables, rows)
    k, v = (x[cache.tables[decodes].long()].flatten(0, 1)[:chunk].transpose(0, 1)[None] for x in (cache.k, cache.v))
    q4 = q[decodes:].transpose(0, 1)[None]

    def before() -> None:
        pd.decode_attention(q[:decodes], pages, lengths)
        F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True)

    new = triton.testing.do_bench(lambda: pa.paged_attention(q, cache, seqs), return_mode="median") * 1e3
    return new, triton.testing.do_bench(before, return_mode="median") * 1e3


def sweep(launches: list[pa.Launch]) -> None:
    """The multi-query grid's tilings on fresh chunks of 2048 and 8192."""
    print("\n| launch | T | us | TFLOP/s |")
    print("|---|---|---|---|")
    for tokens in (2048, 8192):
        (cache,), _ = pools(1, tokens, 1, BF16)
        q = torch.randn(tokens, H, D, device="cuda", dtype=BF16)
        seqs = seqs_for([tokens], [tokens], 0)
        ref = pa.paged_attention_reference(q, cache, seqs)
        for launch in launches:
            run = partial(pa.paged_attention, q, cache, seqs, launch=launch)
            try:
                check(run(), ref, str(launch))
                us = triton.testing.do_bench(run, return_mode="median") * 1e3
            except Exception as e:  # noqa: BLE001 (a tiling that does not compile is a row, not the end)
                print(f"| {tuple(launch)} | {tokens} | {type(e).__name__}: {str(e)[:60]} | |")
                continue
            tflops = 2 * tokens * tokens * H * D / us / 1e6
            print(f"| {tuple(launch)} | {tokens} | {us:.0f} | {tflops:.0f} |", flush=True)


def diagnose_fp8() -> None:
    """Which sequences of the GPU test's fp8 batches come out non-finite, called whole and split into
    its one-query and multi-query parts, with the test's scales and with scales of 0.5."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
    from paged_cases import MIXED, make_batch

    for scales in ((0.05, 0.02), (0.5, 0.5)):
        for dtype in (BF16, torch.float32):
            queries, lengths, singles = MIXED
            q, cache, seqs, _ = make_batch(queries, lengths, singles, H, HKV, D, PAGE, dtype, torch.float8_e4m3fn,
                                           seed=1, scales=scales)  # fmt: skip
            q = q.cuda()
            cache = pa.PagedKV(cache.k.cuda(), cache.v.cuda(), cache.tables.cuda(), *scales)
            cu, lens, rows = (x.cuda() for x in (seqs.cu_q, seqs.lengths, seqs.rows))
            whole = pa.paged_attention(q, cache, pa.Sequences(cu, lens, rows, singles))
            parts = [pa.paged_attention(q[:singles].clone(), cache, pa.Sequences(cu[: singles + 1], lens[:singles],
                                                                                rows[:singles], singles))]  # fmt: skip
            rest_cu = cu[singles:] - cu[singles]
            parts.append(pa.paged_attention(q[singles:].clone(), cache, pa.Sequences(rest_cu, lens[singles:],
                                                                                    rows[singles:], 0)))  # fmt: skip
            split = torch.cat(parts)
            for name, out in (("whole", whole), ("split", split)):
                bad = [(~out[int(cu[i]) : int(cu[i + 1])].isfinite()).sum().item() for i in range(len(queries))]
                print(f"fp8 scales={scales} q={dtype} {name}: non-finite per sequence {bad}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="layer pools a decode graph cycles through (default 8)")
    parser.add_argument("--sweep", action="store_true", help="time the multi-query grid's tilings and stop")
    parser.add_argument("--diagnose-fp8", action="store_true", help="find where an fp8 cache's NaN leaks, and stop")
    args = parser.parse_args()
    print(Fingerprint.of().to_json())
    if args.diagnose_fp8:
        diagnose_fp8()
        return
    if args.sweep:
        sweep([pa.Launch(*t) for t in ((128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (128, 128, 8, 2),
                                        (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 4, 3))])  # fmt: skip
        return
    print("| decode | B | ctx | paged_attention us | decode kernel us | new/old | KV TB/s |")
    print("|---|---|---|---|---|---|---|")
    for cache_dtype in (BF16, torch.float8_e4m3fn):
        for batch, ctx in ((1, 1024), (1, 8192), (64, 1024), (256, 1024), (64, 4096)):
            new, old, tbs = decode(batch, ctx, args.layers, cache_dtype)
            name = "bf16" if cache_dtype == BF16 else "fp8"
            print(f"| {name} | {batch} | {ctx} | {new:.1f} | {old:.1f} | {new / old:.2f} | {tbs:.2f} |", flush=True)
    print("\n| prefill T | paged_attention us | SDPA us | new/old | TFLOP/s |")
    print("|---|---|---|---|---|")
    for tokens in (512, 2048, 8192):
        new, old, tflops = prefill(tokens)
        print(f"| {tokens} | {new:.0f} | {old:.0f} | {new / old:.2f} | {tflops:.0f} |", flush=True)
    new, old = mixed()
    print(f"\nmixed 255 decodes @1024 + 2048 fresh: paged_attention {new:.0f} us, decode kernel + SDPA {old:.0f} us")


if __name__ == "__main__":
    main()
