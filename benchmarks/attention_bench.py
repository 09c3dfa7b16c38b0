"""Attention on Llama-3.1-8B's heads (32 query, 8 KV, head 128, bf16): fp8route's paths against
FlashInfer's, each checked against the SDPA reference first.

Decode: fp8route's paged split-KV Triton kernel against FlashInfer's BatchDecodeWithPagedKVCacheWrapper
over the same paged pool (NHD blocks of PAGE tokens, each row's blocks in its table), timed inside a
CUDA graph over `--layers` distinct layer pools (so L2 holds none of them). Prefill: SDPA
(causal, GQA) against FlashInfer's ragged prefill, timed back to back with events.

    python3 benchmarks/attention_bench.py [--max-seq-len 8192] [--layers 8] [--splits 128,256,512]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from fp8route.engine.attention import decode_attention_torch
from fp8route.kernels.paged_decode import Pages, decode_attention
from fp8route.routing.fingerprint import Fingerprint
from fp8route.tuning.timing import time_graph

H, HKV, D = 32, 8, 128
PAGE = 16
BF16 = torch.bfloat16


def decode_operands(batch: int, args: argparse.Namespace) -> tuple[list[Pages], torch.Tensor]:
    """--layers distinct paged pools of --max-seq-len positions per row (block 0 left as scratch), so
    L2 holds none, and one query."""
    per_row = args.max_seq_len // PAGE
    tables = (1 + torch.arange(batch * per_row, dtype=torch.int32, device="cuda")).view(batch, per_row)
    rows = torch.arange(batch, device="cuda")
    shape = (1 + batch * per_row, PAGE, HKV, D)
    pools = [Pages(torch.randn(shape, device="cuda", dtype=BF16), torch.randn(shape, device="cuda", dtype=BF16),
                   tables, rows) for _ in range(args.layers)]  # fmt: skip
    return pools, torch.randn(batch, H, D, device="cuda", dtype=BF16)


def reference(q: torch.Tensor, pages: Pages, lengths: torch.Tensor) -> torch.Tensor:
    index = pages.tables[pages.rows].long()
    k, v = (x[index].flatten(1, 2).transpose(1, 2) for x in (pages.k, pages.v))
    return decode_attention_torch(q, k, v, lengths)


def decode_rows(args: argparse.Namespace, flashinfer) -> list[str]:  # type: ignore[no-untyped-def]
    rows = []
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    for batch in (1, 16):
        caches, q = decode_operands(batch, args)
        for ctx in (1024, 4096):
            lengths = torch.full((batch,), ctx, device="cuda", dtype=torch.int64)
            ref = reference(q, caches[0], lengths)
            out = decode_attention(q, caches[0], lengths)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
            start = time.perf_counter()
            pages = -(-ctx // PAGE)
            plan_args = (
                torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32, device="cuda"),
                caches[0].tables[:, :pages].flatten().contiguous(),
                torch.full((batch,), ctx - (pages - 1) * PAGE, dtype=torch.int32, device="cuda"),
                H, HKV, D, PAGE,
            )  # fmt: skip
            wrapper.plan(*plan_args, q_data_type=BF16, kv_data_type=BF16)
            theirs = wrapper.run(q, (caches[0].k, caches[0].v))
            torch.cuda.synchronize()
            first_s = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(100):
                wrapper.plan(*plan_args, q_data_type=BF16, kv_data_type=BF16)
            plan_us = (time.perf_counter() - start) * 1e4
            ours = [partial(decode_attention, q, pages, lengths) for pages in caches]
            ours_us = statistics.median(time_graph(ours))
            theirs_us = statistics.median(time_graph([partial(wrapper.run, q, (c.k, c.v)) for c in caches]))
            rows.append(
                f"decode  b={batch:<3} ctx={ctx:<5} ours {ours_us:7.1f} us  flashinfer {theirs_us:7.1f} us  "
                f"flashinfer/ours {theirs_us / ours_us:5.2f}  |err| ours {err(out, ref):.1e} "
                f"flashinfer {err(theirs, ref):.1e}  plan {plan_us:.0f} us/step  first call {first_s:.1f} s"
            )
            print(rows[-1], flush=True)
    return rows


def split_rows(args: argparse.Namespace) -> list[str]:
    """fp8route's decode kernel at each positions-per-program in --splits (0: its default; no FlashInfer)."""
    rows = []
    splits = [int(v) for v in args.splits.split(",")]
    for batch in (1, 4, 16, 32):
        caches, q = decode_operands(batch, args)
        for ctx in (256, 1024, 4096):
            lengths = torch.full((batch,), ctx, device="cuda", dtype=torch.int64)
            ref = reference(q, caches[0], lengths)
            times = []
            for split in splits:
                assert err(decode_attention(q, caches[0], lengths, split=split or None), ref) < 2e-2
                calls = [partial(decode_attention, q, pages, lengths, split=split or None) for pages in caches]
                times.append(statistics.median(time_graph(calls)))
            cells = "  ".join(f"{split or 'default'}: {t:6.1f}" for split, t in zip(splits, times))
            best = splits[times.index(min(times))]
            rows.append(f"split   b={batch:<3} ctx={ctx:<5} us per call by split  {cells}   best {best}")
            print(rows[-1], flush=True)
        del caches
    return rows


def prefill_rows(flashinfer) -> list[str]:  # type: ignore[no-untyped-def]
    rows = []
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    for batch, t in ((1, 1024), (1, 4096), (8, 1024)):
        q = torch.randn(batch, H, t, D, device="cuda", dtype=BF16)
        k = torch.randn(batch, HKV, t, D, device="cuda", dtype=BF16)
        v = torch.randn(batch, HKV, t, D, device="cuda", dtype=BF16)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        # FlashInfer's ragged layout: [tokens, heads, D] rows of every sequence back to back.
        qn, kn, vn = (x.transpose(1, 2).reshape(batch * t, -1, D).contiguous() for x in (q, k, v))
        indptr = torch.arange(0, (batch + 1) * t, t, dtype=torch.int32, device="cuda")
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        start = time.perf_counter()
        wrapper.plan(indptr, indptr, H, HKV, D, causal=True, q_data_type=BF16, kv_data_type=BF16)
        theirs = wrapper.run(qn, kn, vn).reshape(batch, t, H, D).transpose(1, 2)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - start
        sdpa_us = event_us(partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True))
        theirs_us = event_us(partial(wrapper.run, qn, kn, vn))
        rows.append(
            f"prefill {batch}x{t:<5}  sdpa {sdpa_us:8.1f} us  flashinfer {theirs_us:8.1f} us  "
            f"flashinfer/sdpa {theirs_us / sdpa_us:5.2f}  |err| {err(theirs, ref):.1e}  first call {first_s:.1f} s"
        )
        print(rows[-1], flush=True)
    return rows


def event_us(fn, repeats: int = 20) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--splits", help="instead: fp8route's decode kernel per split size, e.g. 128,256,512")
    args = parser.parse_args()
    print(f"on {Fingerprint.of('cuda').summary()}")
    if args.splits:
        rows = split_rows(args)
    else:
        import flashinfer

        rows = decode_rows(args, flashinfer) + prefill_rows(flashinfer)
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
