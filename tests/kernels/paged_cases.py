"""Batches for the paged attention tests: sequences of any query count and length over shuffled blocks
of a pool, and a plain float64 reference (for the paged attention tests on a CPU, under Triton's
interpreter and on a GPU)."""

from __future__ import annotations

import torch

from fp8route.kernels import paged_attention as pa


def make_batch(
    queries: list[int],
    lengths: list[int],
    singles: int,
    h: int,
    hkv: int,
    d: int,
    page: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    seed: int = 0,
    scales: tuple[float, float] = (1.0, 1.0),
):
    """Random q and K/V for sequences of these query counts and lengths, K/V scattered over shuffled
    blocks of a pool whose other blocks hold NaN; (q, cache, seqs, dense K/V per sequence in fp64)."""
    g = torch.Generator().manual_seed(seed)
    blocks_each = [-(-n // page) for n in lengths]
    order = torch.randperm(sum(blocks_each) + 3, generator=g) + 1  # spare blocks stay NaN
    k_pool = torch.full((len(order) + 1, page, hkv, d), float("nan")).to(cache_dtype)
    v_pool = torch.full_like(k_pool, float("nan"))
    tables = torch.zeros(len(lengths) + 1, max(blocks_each), dtype=torch.int32)
    dense, used = [], 0
    for i, n in enumerate(lengths):
        # What the cache holds (in cache units), and what a read of it gives, in float64.
        # Saturated at e4m3's range by hand: a cast of what lies past it is NaN in some torch builds.
        k, v = ((torch.randn(n, hkv, d, generator=g) * 2 / s).clamp(-448, 448).to(cache_dtype) for s in scales)
        mine = order[used : used + blocks_each[i]]
        used += blocks_each[i]
        tables[i, : len(mine)] = mine.to(torch.int32)
        for j, block in enumerate(mine.tolist()):
            part = slice(j * page, min((j + 1) * page, n))
            k_pool[block, : part.stop - part.start] = k[part]
            v_pool[block, : part.stop - part.start] = v[part]
        dense.append((k.double() * scales[0], v.double() * scales[1]))
    q = torch.randn(sum(queries), h, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    seqs = pa.Sequences(cu, torch.tensor(lengths, dtype=torch.int32), torch.arange(len(lengths)), singles)
    cache = pa.PagedKV(k_pool, v_pool, tables, *scales)
    return q, cache, seqs, dense


def reference(q: torch.Tensor, queries: list[int], lengths: list[int], dense, hkv: int) -> torch.Tensor:
    """Per sequence, in float64: query j of a sequence of length L and q_len queries sees 0 .. L - q_len + j."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // hkv
    start = 0
    for n, length, (k, v) in zip(queries, lengths, dense):
        qi = q[start : start + n].double().transpose(0, 1)  # [H, n, D]
        kk = k.transpose(0, 1).repeat_interleave(group, 0)  # [H, L, D]
        vv = v.transpose(0, 1).repeat_interleave(group, 0)
        scores = qi @ kk.transpose(1, 2) / q.shape[-1] ** 0.5
        sees = length - n + torch.arange(n)
        scores = scores.masked_fill(torch.arange(length)[None, :] > sees[:, None], float("-inf"))
        out[start : start + n] = (scores.softmax(-1) @ vv).transpose(0, 1)
        start += n
    return out


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


# Decode rows first (one of 1 position, one of many segments), then a fresh chunk over several query
# blocks, a chunk continuing a cached prefix that ends off a block boundary, a one-token chunk.
MIXED = ([1, 1, 1, 1, 70, 20, 1, 33], [1, 37, 300, 1000, 70, 100, 9, 33], 4)
