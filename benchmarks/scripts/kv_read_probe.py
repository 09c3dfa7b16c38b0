"""Issue 48's FP8 KV read: the rate the decode kernel's e4m3 tiles reach against a plain read of the same tiles, and
whether capping its registers (more programs a SM) closes the gap. Per case (rows x positions), 8 layers' pools
(L2 holds none) replayed from one CUDA graph, µs a layer (median of 20 replays) and the KV bytes' rate as a
fraction of the run's copy bandwidth:

- read BLOCKxWARPSxSTAGES: a Triton kernel that reads each row's K and V tiles through its block table, as the
  decode kernel does (the same pages, (row, KV head) grid and programs per pair), and folds them with XOR:
  what this access pattern allows without the attention's work;
- decode LAUNCH[/sSPLIT] rN: decode_attention with the new token fused (at splits of SPLIT positions where
  given), launched with at most N registers a thread (ptxas's `maxnreg`; without it ptxas takes 203-255 for the
  e4m3 tiles, two programs a SM, where 128 leaves room for four);
- one-query LAUNCH (--one-query-launches): the same rows as a mixed step's decode rows, through the paged
  attention kernel's one-query grid with its counts on the device (a captured step's form) and its merge.

    PYTHONPATH=$PWD python3 benchmarks/scripts/kv_read_probe.py [--cases 64x4096,1x32768] [--regs 0,168,128]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics

import torch
import triton
import triton.language as tl

from fp8route.bench import attention as ab
from fp8route.device import launch_sms
from fp8route.kernels import paged_decode as pd
from fp8route.tuning.timing import copy_bandwidth_gbs, time_graph

FP8 = torch.float8_e4m3fn
LAYERS = 8  # pools of 0.13-1.1 GB a layer: L2 (50-60 MB) holds none of the next
LAUNCHES = {
    torch.bfloat16: ["64x4x3", "128x4x3"],
    FP8: ["128x4x2h", "128x4x3h", "64x4x3h", "64x4x4h", "128x8x2h"],
}


@triton.jit
def _read_kernel(
    k_ptr, v_ptr, tab_ptr, out_ptr, length, per_program, stride_blk, stride_s, stride_h, stride_tab,
    PAGE: tl.constexpr, BLOCK: tl.constexpr, WORDS: tl.constexpr,
):  # fmt: skip
    b, kvh, first = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    table = tab_ptr + b.to(tl.int64) * stride_tab
    w = tl.arange(0, WORDS)
    acc = tl.zeros([BLOCK, WORDS], dtype=tl.int32)
    start = first * per_program
    for n0 in range(start, tl.minimum(start + per_program, length), BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        n_mask = n < length
        blocks = tl.load(table + n // PAGE, mask=n_mask, other=0).to(tl.int64)
        at = blocks * stride_blk + (n % PAGE) * stride_s + kvh * stride_h
        acc ^= tl.load(k_ptr + at[:, None] + w[None, :], mask=n_mask[:, None], other=0)
        acc ^= tl.load(v_ptr + at[:, None] + w[None, :], mask=n_mask[:, None], other=0)
    tl.store(out_ptr + (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + first, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def _read(c: ab.pa.PagedKV, batch: int, ctx: int, programs: int, launch: pd.Launch, out: torch.Tensor) -> None:
    k, v = (x.view(torch.int32) for x in (c.k, c.v))  # 4 bytes a word whatever the cache's dtype
    per = triton.cdiv(triton.cdiv(ctx, programs), launch.block) * launch.block
    _read_kernel[(batch, ab.HKV, programs)](
        k, v, c.tables, out, ctx, per, k.stride(0), k.stride(1), k.stride(2), c.tables.stride(0),
        PAGE=ab.PAGE, BLOCK=launch.block, WORDS=k.shape[-1], num_warps=launch.warps, num_stages=launch.stages,
    )  # fmt: skip


def _decode(c: ab.pa.PagedKV, q, token, seqs, launch: pd.Launch, split: int | None) -> None:  # noqa: ANN001 (a probe's plumbing)
    pages = pd.Pages(c.k, c.v, c.tables, seqs.rows, c.k_scale, c.v_scale)
    pd.decode_attention(q, pages, seqs.lengths.long(), new=token, launch=launch, split=split)


def _one_query(c: ab.pa.PagedKV, q, seqs, launch: pd.Launch, out: torch.Tensor) -> None:  # noqa: ANN001 (a probe's plumbing)
    ab.pa.paged_attention(q, c, seqs, out=out, one_query=launch)


def _with_regs(regs: int) -> None:
    """decode_attention's kernels launched with at most `regs` registers a thread (0: ptxas's choice)."""
    import fp8route.kernels.pdl as pdl

    pd.launch_options = (lambda: {**pdl.launch_options(), "maxnreg": regs}) if regs else pdl.launch_options


def case(
    batch: int, ctx: int, dtype: torch.dtype, launches: list[str], regs: list[int], read: bool, copy_gbs: float,
    one_query: list[str],
) -> None:  # fmt: skip
    caches = ab._pools(batch, ctx, LAYERS, dtype)
    q = torch.randn(batch, ab.H, ab.D, device="cuda", dtype=ab.BF16)
    k_new, v_new = (torch.randn(batch, ab.HKV, ab.D, device="cuda", dtype=ab.BF16) for _ in range(2))
    cos, sin = torch.ones(batch, ab.D, device="cuda"), torch.zeros(batch, ab.D, device="cuda")
    token = pd.NewToken(k_new, v_new, cos, sin)
    seqs = ab._sequences([1] * batch, [ctx] * batch, batch)
    kv_bytes = 2 * batch * ctx * ab.HKV * ab.D * dtype.itemsize
    name = "e4m3" if dtype == FP8 else "bf16"

    def show(what: str, calls: list) -> None:  # type: ignore[type-arg]
        try:
            us = statistics.median(time_graph(calls, repeats=20))
        except Exception as exc:  # noqa: BLE001 (a launch that cannot run is a line, not the end)
            print(f"{name} {batch}x{ctx} {what:22s} {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            return
        frac = kv_bytes / (us * 1e-6) / 1e9 / copy_gbs
        print(f"{name} {batch}x{ctx} {what:22s} {us:8.2f} us/layer  {frac:.2f} of copy", flush=True)

    pairs = batch * ab.HKV
    for text in launches:
        tiling, _, split_text = text.partition("/s")  # "64x4x3h-r128/s256": that launch at splits of 256
        launch, split = pd.Launch.parse(tiling), int(split_text) if split_text else None
        for programs in sorted(
            {pd.programs_for(pairs, 64, launch_sms(q.device)), max(1, 1024 // pairs)} if read else []
        ):
            out = torch.empty(batch * ab.HKV * programs, dtype=torch.int32, device="cuda")
            calls = [functools.partial(_read, c, batch, ctx, programs, launch, out) for c in caches]
            show(f"read {launch.block}x{launch.warps}x{launch.stages} p{programs}", calls)
        for reg in regs:
            _with_regs(reg)
            calls = [functools.partial(_decode, c, q, token, seqs, launch, split) for c in caches]
            show(f"decode {text} r{reg or '-'}", calls)
        _with_regs(0)
    counted = dataclasses.replace(seqs, counts=torch.tensor([batch, batch], dtype=torch.int32, device="cuda"))
    out = torch.empty_like(q)
    for text in one_query:
        calls = [functools.partial(_one_query, c, q, counted, pd.Launch.parse(text), out) for c in caches]
        show(f"one-query {text}", calls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="64x4096,1x32768", help="ROWSxPOSITIONS,...")
    parser.add_argument("--regs", default="0,168,128", help="register caps for the decode arms (0: none)")
    parser.add_argument("--dtypes", default="bf16,e4m3", help="cache dtypes: bf16, e4m3")
    parser.add_argument("--bf16-launches", default=",".join(LAUNCHES[torch.bfloat16]))
    parser.add_argument("--e4m3-launches", default=",".join(LAUNCHES[FP8]))
    parser.add_argument("--no-read", action="store_true", help="no plain-read arms")
    parser.add_argument(
        "--one-query-launches",
        default="",
        help="the one-query grid's launches (default: 64x4x3 bf16, 64x4x3hg-r128 fp8)",
    )
    args = parser.parse_args()
    copy_gbs = copy_bandwidth_gbs(1 << 30, repeats=5)
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s (read + write)", flush=True)
    regs = [int(r) for r in args.regs.split(",")]
    for item in args.cases.split(","):
        batch, ctx = (int(x) for x in item.split("x"))
        for name in args.dtypes.split(","):
            dtype = FP8 if name == "e4m3" else torch.bfloat16
            launches = getattr(args, f"{name}_launches").split(",")
            one_query = [t for t in args.one_query_launches.split(",") if t]
            case(batch, ctx, dtype, launches, regs, not args.no_read, copy_gbs, one_query)


if __name__ == "__main__":
    main()
