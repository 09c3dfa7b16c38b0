"""Issue 48's small-batch decode: the decode kernel's positions per split for 1, 2 and 4 rows of 512 to 16384
positions, bf16 and e4m3 caches. Per case, 32 layers' decode_attention (the new token fused), each over its own
pool (L2 holds none), replayed from one CUDA graph (time_graph: µs per call, median of 20 replays), at splits of
64, 128 and 256 positions (the e4m3 tile is 128: no 64 there); `*` marks the default split_len's split. The
default now also cuts a small batch's short rows finer (target_splits): compare the rows against it with
bench e2e.

--long: one row of 16384 and 32768 positions (issue 48's batch-1 long-context figures), where the split count's
cap (64) sets the split: caps of 64 / 128 / 256 splits, programs per KV head by programs_for or one per split,
and the kernel's tiles (positions, warps, stages), each at its smallest split.

    PYTHONPATH=$PWD python3 benchmarks/scripts/decode_split_sweep.py [--long]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from fp8route.bench import attention as ab
from fp8route.kernels import paged_decode as pd
from fp8route.tuning.timing import time_graph

FP8 = torch.float8_e4m3fn
LAYERS = 32


def layer_us(
    dtype: torch.dtype, batch: int, ctx: int, split: int, launch: pd.Launch | None = None, all_splits: bool = False,
    caches: list[ab.pa.PagedKV] | None = None,
) -> float:  # fmt: skip
    caches = caches or ab._pools(batch, ctx, LAYERS, dtype)
    q = torch.randn(batch, ab.H, ab.D, device="cuda", dtype=ab.BF16)
    k_new, v_new = (torch.randn(batch, 1, ab.HKV, ab.D, device="cuda", dtype=ab.BF16) for _ in range(2))
    cos, sin = torch.ones(batch, 1, ab.D, device="cuda"), torch.zeros(batch, 1, ab.D, device="cuda")
    seqs = ab._sequences([1] * batch, [ctx] * batch, batch)
    token = pd.NewToken(k_new[:, 0], v_new[:, 0], cos[:, 0], sin[:, 0])
    programs = min(pd._MAX_SPLITS, -(-ctx // split)) if all_splits else None

    def call(c: ab.pa.PagedKV) -> None:
        pages = pd.Pages(c.k, c.v, c.tables, seqs.rows, c.k_scale, c.v_scale)
        pd.decode_attention(q, pages, seqs.lengths.long(), new=token, split=split, launch=launch, programs=programs)

    return statistics.median(time_graph([functools.partial(call, c) for c in caches], repeats=20))


def long_rows() -> None:
    tiles = {
        ab.BF16: [pd.Launch(), pd.Launch(64, 4, 4), pd.Launch(128, 4, 2), pd.Launch(128, 8, 2)],
        FP8: [pd.LAUNCH[True], pd.Launch(128, 4, 3, True), pd.Launch(128, 8, 2, True), pd.Launch(256, 8, 2, True)],
    }
    for dtype, launches in tiles.items():
        for ctx in (16384, 32768):
            caches = ab._pools(1, ctx, LAYERS, dtype)
            for cap in (64, 128, 256):
                pd._MAX_SPLITS = cap  # the kernels take it as a constexpr: a module constant read per call
                for launch in launches:
                    cells = []
                    for every in (False, True):
                        name = "one per split" if every else "programs_for"
                        try:
                            cells.append(f"{name}: {layer_us(dtype, 1, ctx, launch.block, launch, every, caches):.2f}")
                        except Exception as exc:  # noqa: BLE001 (a tile that does not fit is a cell, not the end)
                            cells.append(f"{name}: {type(exc).__name__}")
                    line = f"{str(dtype)[6:]:14s} ctx {ctx}: cap {cap} splits, {launch}: us/layer " + ", ".join(cells)
                    print(line, flush=True)
            del caches
    pd._MAX_SPLITS = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--long", action="store_true", help="one long row: the split cap, programs and tiles")
    if parser.parse_args().long:
        long_rows()
        return
    for dtype in (ab.BF16, FP8):
        for batch in (1, 2, 4):
            for ctx in (512, 1024, 4096, 16384):
                cells = []
                for split in (64, 128, 256):
                    if split % pd.LAUNCH[dtype == FP8].block:
                        continue
                    mark = "*" if split == pd.split_len(batch * ab.HKV) else ""
                    cells.append(f"{split}{mark}: {layer_us(dtype, batch, ctx, split):.2f}")
                print(f"{str(dtype)[6:]:14s} batch {batch} ctx {ctx:5d}: us/layer " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
