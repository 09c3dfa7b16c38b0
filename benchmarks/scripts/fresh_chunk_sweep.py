"""The paged attention kernel on one fresh chunk, against cuDNN's SDPA, in one process: the kernel as
it is, the kernel of an earlier tree (--before: a copy of its paged_attention.py), tilings (--launches),
the chunk repaged into larger blocks (--pages), and a TMA prototype (below) over the chunk's contiguous
K/V and over those larger blocks.

    PYTHONPATH=$PWD python3 benchmarks/scripts/fresh_chunk_sweep.py --before OLD.py --launches 256x128x8x2

Rounds alternate the arms; each cell is the median µs of its rounds (Triton's do_bench median in each),
with the spread (max / min - 1) across rounds. Every arm is checked against the kernel's torch path
first; one that fails or cannot run prints a line instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections.abc import Callable
from types import ModuleType

import torch
import triton
import triton.language as tl

from fp8route.bench import attention as bench
from fp8route.kernels import paged_attention as pa


def _module_at(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("paged_attention_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# A prototype, for measurement only: one fresh sequence's causal attention with each tile of K and V
# loaded through a TMA descriptor instead of gathered row by row; over its own K/V held contiguous
# ([T, Hkv, D], as the step's projections leave them after RoPE; PAGE = 0), or over a paged cache whose
# blocks hold whole tiles (PAGE a multiple of TILE: one table read a tile). Query rows pack the G heads
# of a KV head for BLOCK_Q tokens, as the paged kernel's multi-query grid does.
@triton.jit
def _tma_tile(
    q, tok, acc, m_i, l_i, n0, T, k_desc, v_desc, table_ptr, kvh, qk_scale,
    D: tl.constexpr, TILE: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Positions n0 .. n0 + TILE - 1 into the online softmax; MASKED: the causal diagonal or the end."""
    row = n0 if PAGE == 0 else tl.load(table_ptr + n0 // PAGE) * PAGE + n0 % PAGE
    s = tl.dot(q, tl.trans(k_desc.load([row, kvh * D])))
    if MASKED:
        pos = n0 + tl.arange(0, TILE)
        s = tl.where((pos[None, :] <= tok[:, None]) & (pos[None, :] < T), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    p = tl.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = v_desc.load([row, kvh * D])
    return tl.dot(p.to(v.dtype), v, acc * alpha[:, None]), m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _fresh_tma_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, o_ptr, T, ROWS, qk_scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
    PAGE: tl.constexpr,
):  # fmt: skip
    BLOCK_Q: tl.constexpr = BLOCK_M // G
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    tok = block * BLOCK_Q + m // G
    heads = kvh * G + m % G
    live = tok < T
    row_at = tok.to(tl.int64)[:, None] * (HKV * G * D) + heads[:, None] * D + d[None, :]
    q = tl.load(q_ptr + row_at, mask=live[:, None], other=0.0)
    k_desc = tl.make_tensor_descriptor(k_ptr, [ROWS, HKV * D], [HKV * D, 1], [TILE, D])
    v_desc = tl.make_tensor_descriptor(v_ptr, [ROWS, HKV * D], [HKV * D, 1], [TILE, D])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    end = tl.minimum((block + 1) * BLOCK_Q, T)
    whole = block * BLOCK_Q // TILE * TILE
    for n0 in range(0, whole, TILE):
        acc, m_i, l_i = _tma_tile(q, tok, acc, m_i, l_i, n0, T, k_desc, v_desc, table_ptr, kvh, qk_scale,
                                  D, TILE, PAGE, False)  # fmt: skip
    for n0 in range(whole, end, TILE):
        acc, m_i, l_i = _tma_tile(q, tok, acc, m_i, l_i, n0, T, k_desc, v_desc, table_ptr, kvh, qk_scale,
                                  D, TILE, PAGE, True)  # fmt: skip
    tl.store(o_ptr + row_at, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=live[:, None])


def _fresh_tma(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, launch: pa.Launch, table: torch.Tensor | None = None
) -> Callable[[], torch.Tensor]:
    """q [T, H, D]; k and v [T, Hkv, D] contiguous, or with a table [blocks] the blocks [n, PAGE, Hkv, D]
    of a paged cache -> the prototype's call."""
    t, h, d = q.shape
    hkv, page = k.shape[-2], 0 if table is None else k.shape[1]
    rows = k.numel() // (hkv * d)
    out = torch.empty_like(q)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    block_q = launch.block_m // (h // hkv)
    grid = (triton.cdiv(t, block_q), hkv)

    def call() -> torch.Tensor:
        _fresh_tma_kernel[grid](q, k, v, k if table is None else table, out, t, rows, d**-0.5 * 1.4426950408889634,
                                HKV=hkv, G=h // hkv, D=d, BLOCK_M=launch.block_m, TILE=launch.tile, PAGE=page,
                                num_warps=launch.warps, num_stages=launch.stages)  # fmt: skip
        return out

    return call


def _placed(blocks: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """blocks[i] stored at block at[i] (through bytes: fp8 has no index_put)."""
    out = torch.empty_like(blocks)
    out.view(torch.uint8)[at] = blocks.view(torch.uint8)
    return out


def _repaged(cache: pa.PagedKV, tokens: int, page: int) -> pa.PagedKV:
    """Row 0's first `tokens` positions of `cache` in blocks of `page` positions, the blocks shuffled."""
    blocks = -(-tokens // page)
    k, v = (x[cache.tables[0].long()].flatten(0, 1)[: blocks * page] for x in (cache.k, cache.v))
    k, v = (x.reshape(blocks, page, *x.shape[1:]) for x in (k, v))
    table = torch.randperm(blocks, device="cuda")
    k, v = (_placed(x, table) for x in (k, v))
    return pa.PagedKV(k, v, table.int()[None], cache.k_scale, cache.v_scale)


def _arms(
    tokens: int, dtype: torch.dtype, before: ModuleType | None, launches: list[pa.Launch], pages: list[int]
) -> dict:
    (cache,) = bench._pools(1, tokens, 1, dtype)
    q = torch.randn(tokens, bench.H, bench.D, device="cuda", dtype=bench.BF16)
    seqs = bench._sequences([tokens], [tokens], 0)
    expected = pa.paged_attention_reference(q, cache, seqs)
    arms: dict[str, Callable[[], torch.Tensor]] = {"now": lambda: pa.paged_attention(q, cache, seqs)}
    if before is not None:
        old = before.PagedKV(*cache)
        arms["before"] = lambda: before.paged_attention(q, old, seqs)
    for launch in launches:
        arms["x".join(map(str, launch))] = lambda launch=launch: pa.paged_attention(q, cache, seqs, launch=launch)
    for page in pages:  # the same positions in larger blocks: what paging itself costs
        big = _repaged(cache, tokens, page)
        arms[f"page{page}"] = lambda big=big: pa.paged_attention(q, big, seqs)
        if dtype == bench.BF16:
            for launch in [pa.MULTI, *launches]:
                if page % launch.tile == 0:
                    name = f"tma page{page} " + "x".join(map(str, launch))
                    arms[name] = _fresh_tma(q, big.k, big.v, launch, big.tables[0])
    if dtype == bench.BF16:
        k, v = bench._own_kv(cache, 0, tokens)
        arms["cuDNN"] = bench._cudnn_prefill(q.transpose(0, 1)[None], k, v)
        k_flat, v_flat = (x[0].transpose(0, 1).contiguous() for x in (k, v))
        for launch in [pa.MULTI, *launches]:
            arms["tma " + "x".join(map(str, launch))] = _fresh_tma(q, k_flat, v_flat, launch)
    checked = {}
    for name, call in arms.items():
        try:
            bench._check(call(), expected, f"{name} at {tokens}")
            checked[name] = call
        except Exception as exc:  # noqa: BLE001 (an arm that fails is a line, not the end of the run)
            print(f"{name} at {tokens} ({dtype}): {type(exc).__name__}: {str(exc)[:160]}")
    return checked


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", help="an earlier tree's fp8route/kernels/paged_attention.py")
    parser.add_argument("--launches", default="256x128x8x2,256x128x8x3,128x128x8x2")
    parser.add_argument("--pages", default="128", help="block sizes to repage the chunk into")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", default="2048,4096,8192")
    args = parser.parse_args()
    before = _module_at(args.before) if args.before else None
    launches = bench.parse_launches(args.launches)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; µs median of {args.rounds} rounds (spread)")
    for dtype in (bench.BF16, torch.float8_e4m3fn):
        for tokens in (int(t) for t in args.tokens.split(",")):
            arms = _arms(tokens, dtype, before, launches, [int(p) for p in args.pages.split(",") if p])
            times: dict[str, list[float]] = {name: [] for name in arms}
            for _ in range(args.rounds):
                for name, call in arms.items():
                    times[name].append(bench._median_us(call))
            med = {name: statistics.median(ts) for name, ts in times.items()}
            cells = [f"{n} {med[n]:.0f} ({max(ts) / min(ts) - 1:.1%})" for n, ts in times.items()]
            print(f"{str(dtype)[6:]:14} T={tokens:5}  " + "  ".join(cells))
            base = med.get("cuDNN") or med.get("before")
            if base:
                ratios = "  ".join(f"{n} {base / med[n]:.3f}" for n in med)
                print(f"{'':14} vs {'cuDNN' if 'cuDNN' in med else 'before'} (its µs / the arm's): {ratios}")


if __name__ == "__main__":
    main()
