"""The paged decode attention kernel alone over a filled cache, bf16 against fp8 blocks, for a list of
launch configurations (paged_decode.Launch): each checked against a torch reference first, then timed
in a CUDA graph over --layers distinct pools (so L2 holds none), as GB/s of KV read against the copy
bandwidth of the run; both as called bare ("plain") and with the step's new token fused ("new": RoPE
and the cache write inside, as the engine's decode step calls it). Llama-3.1-8B's heads (32 query,
8 KV, head 128), pages of 16.

    python3 benchmarks/kv_decode_attention.py [--cases 64x4096,1x32768] [--out DIR]

A launch is BLOCKxWARPSxSTAGES[h][/SPLIT] (h: an fp8 cache's tiles meet q in fp16; SPLIT: positions
per program, default split_len), e.g. 64x4x3, 128x8x3h or 128x4x2h/512; or FlashInfer's paged decode
over the same blocks ("fi-tc": its tensor-core kernel, "fi": its CUDA-core one; the flashinfer extra),
timed as the plain path (the engine rotates and writes the new token before it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

import torch

from fp8route.engine.attention import decode_attention_torch
from fp8route.engine.kv_quant import quantize_kv
from fp8route.kernels.paged_decode import LAUNCH, Launch, NewToken, Pages, decode_attention
from fp8route.tuning.timing import copy_bandwidth_gbs, time_graph

H, HKV, D, PAGE = 32, 8, 128, 16
SCALE = 0.05  # K/V of unit variance quantized with it: e4m3's range used well, nothing saturated


def parse_launch(text: str) -> tuple[Launch, int | None]:
    """BLOCKxWARPSxSTAGES[h][/SPLIT] -> (the launch, the split or None for split_len)."""
    text, _, split = text.partition("/")
    return Launch.parse(text), int(split) if split else None


def pools(batch: int, filled: int, fp8: bool, layers: int, layout: str = "nhd") -> list[Pages]:
    """Blocks [num_blocks, PAGE, HKV, D] as the kernel indexes them; stored that way ("nhd", the
    pool's) or head-major ("hnd": a block's positions of one head contiguous, seen through a view)."""
    per_row = -(-filled // PAGE)
    tables = (1 + torch.randperm(batch * per_row, device="cuda")).to(torch.int32).view(batch, per_row)
    rows = torch.arange(batch, device="cuda")
    shape = (1 + batch * per_row, PAGE, HKV, D) if layout == "nhd" else (1 + batch * per_row, HKV, PAGE, D)
    out = []
    for _ in range(layers):
        k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        if fp8:
            k, v = quantize_kv(k, SCALE), quantize_kv(v, SCALE)
        if layout == "hnd":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        out.append(Pages(k, v, tables, rows, *((SCALE, SCALE) if fp8 else (1.0, 1.0))))
    return out


def new_token(batch: int) -> NewToken:
    """A step's new key and value with RoPE tables at some angle (their values do not change the time)."""
    k, v = (torch.randn(batch, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    angle = torch.rand(batch, D // 2, device="cuda").repeat(1, 2)
    return NewToken(k, v, angle.cos(), angle.sin())


def flashinfer_calls(q: torch.Tensor, caches: list[Pages], lengths: torch.Tensor, tensor_cores: bool) -> list:
    """One FlashInfer decode wrapper planned for these rows (each cache shares the tables), a call per cache."""
    import flashinfer

    batch, per_row = caches[0].tables.shape
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * per_row
    hnd = not caches[0].k.is_contiguous()  # pools(layout="hnd")'s view
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(128 << 20, dtype=torch.uint8, device="cuda"), "HND" if hnd else "NHD", use_cuda_graph=True,
        use_tensor_cores=tensor_cores, paged_kv_indptr_buffer=torch.empty_like(indptr),
        paged_kv_indices_buffer=torch.empty(batch * per_row, dtype=torch.int32, device="cuda"),
        paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device="cuda"),
    )  # fmt: skip
    last = (lengths - (per_row - 1) * PAGE).to(torch.int32)
    kv_dtype = caches[0].k.dtype
    wrapper.plan(indptr, caches[0].tables.flatten(), last, H, HKV, D, PAGE, q_data_type=q.dtype, kv_data_type=kv_dtype)
    fp8 = kv_dtype == torch.float8_e4m3fn
    return [
        partial(
            wrapper.run,
            q,
            (c.k.transpose(1, 2), c.v.transpose(1, 2)) if hnd else (c.k, c.v),
            **({"k_scale": c.k_scale, "v_scale": c.v_scale} if fp8 else {}),
        )
        for c in caches
    ]


def reference(q: torch.Tensor, pages: Pages, lengths: torch.Tensor) -> torch.Tensor:
    index = pages.tables[pages.rows].long()
    k, v = (x[index].flatten(1, 2).transpose(1, 2).float() for x in (pages.k, pages.v))
    return decode_attention_torch(q.float(), k * pages.k_scale, v * pages.v_scale, lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="64x4096,16x4096,1x32768", help="BATCHxFILLED, comma-separated")
    ap.add_argument("--bf16", default="64x4x3,128x4x3,128x8x3", help="launches for a bf16 cache")
    ap.add_argument("--fp8", default="64x4x3,128x4x3,128x4x2,128x4x2h", help="launches for an fp8 cache")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layouts", default="nhd", help="block layouts: nhd (the pool's), hnd (head-major), or both")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; defaults bf16 {LAUNCH[False]}, fp8 {LAUNCH[True]}")
    rows = []
    for case in args.cases.split(","):
        batch, filled = (int(x) for x in case.split("x"))
        lengths = torch.full((batch,), filled, device="cuda", dtype=torch.int64)
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
        new = new_token(batch)
        arms = [(fp8, launches, layout) for layout in args.layouts.split(",") for fp8, launches in
                ((False, args.bf16), (True, args.fp8))]  # fmt: skip
        for fp8, launches, layout in arms:
            caches = pools(batch, filled, fp8, args.layers, layout)
            kv_bytes = 2 * batch * filled * HKV * D * caches[0].k.element_size()
            for text in launches.split(","):
                if text.startswith("fi"):
                    paths = {"plain": flashinfer_calls(q, caches, lengths, tensor_cores=text == "fi-tc")}
                else:
                    launch, split = parse_launch(text)
                    paths = {
                        path: [
                            partial(decode_attention, q, c, lengths, split=split, new=token, launch=launch)
                            for c in caches
                        ]
                        for path, token in (("plain", None), ("new", new))
                    }
                # Against the cache as it is now: an earlier launch's "new" path wrote its token into it.
                ref = reference(q, caches[0], lengths)
                out = paths["plain"][0]().float()
                error = ((out - ref).norm() / ref.norm()).item()
                for path, calls in paths.items():
                    us = time_graph(calls)
                    median = statistics.median(us)
                    gbs = kv_bytes / median / 1e3
                    row = {
                        "batch": batch, "filled": filled, "kv": "fp8" if fp8 else "bf16", "layout": layout,
                        "launch": text, "path": path,
                        "us": median, "us_min": min(us), "us_max": max(us), "gbs": gbs,
                        "of_copy": gbs / copy_gbs, "rel_error": error,
                    }  # fmt: skip
                    rows.append(row)
                    print(
                        f"B={batch:3d} filled={filled:6d} {row['kv']:4s} {layout} {text:9s} {path:5s} {median:8.1f} us "
                        f"[{min(us):.1f}, {max(us):.1f}]  {gbs:6.0f} GB/s ({gbs / copy_gbs:.2f} of copy)  "
                        f"plain's rel err {error:.1e}",
                        flush=True,
                    )
            del caches
            torch.cuda.empty_cache()
    out = Path(args.out) / "kv_decode_attention.json"
    out.write_text(json.dumps({"copy_gbs": copy_gbs, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
