"""Split-KV decode attention in Triton (flash-decoding) over the paged KV cache: one query token per row.

    out[b, h] = softmax(q[b, h] . K_b[h // G, :len[b]] * scale) @ V_b[h // G, :len[b]]

where row b's position p is read from block tables[rows[b], p // BS] at offset p % BS of the
layer's blocks [num_blocks, BS, Hkv, D]. Why a kernel of our own: it reads only each row's filled
positions, wherever their blocks are. Why split-KV: one program per (row, KV head) leaves most
SMs idle at small batch; splitting the sequence puts cdiv(len, SPLIT) programs on each.

CUDA-graph safe: the lengths, table rows and tables are device tensors read inside the kernel, and
the grid is fixed (at most 64 splits a row). Each row's split length is computed in the kernel from
its own length: the tuned length for the batch's (row, KV head) pairs, or longer where the row would
need more than 64 splits, or shorter for a short row of a small batch (target_splits). A program
runs every P-th split of its row from its own index (P programs a row and KV head: by default
programs_for's, sized from the batch, not the table's width), so a cache of 128k positions costs a
short row no work, only programs that find no split of theirs, and the combine kernel counts each
row's valid splits from its length the same way, never reading a stale partial. Offsets are int64: a
pool of many blocks passes 2^31 elements.

Kernel 1, grid (B, Hkv, P): the program loads the G = H / Hkv query heads that share its KV head
(GQA, padded to 16 rows for tl.dot), and for each of its splits streams the split in BLOCK_N-position
tiles with an fp32 online softmax and writes the split's normalized output and log-sum-exp. Given
the step's new token (`NewToken`), it also applies RoPE to the query heads it loads, and the program
one of whose splits holds the row's last position rotates the new key and writes it and the new
value there first: what the RoPE and cache-write kernels would do, at no extra launch.
Kernel 2, grid (B, H): combines a row's valid splits weighted by exp(lse - max lse).

An fp8 cache (float8_e4m3fn blocks, kv_cache_dtype "fp8") is dequantized inside kernel 1: each K/V
tile is loaded as e4m3 (half the bytes) and converted to q's dtype for tl.dot, the key's scale
folded into the score scale and the value's applied to the split's output (both per-tensor, so
exact algebra); the new token is written quantized (x / scale, saturated at +-448) after rounding
to the model's dtype, as the torch write (fp8route.engine.kv_pool.KVPool.store) rounds it. A 16-bit
or fp32 cache compiles the same code as before (FP8 is a constexpr).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fp8route.device import launch_sms
from fp8route.errors import Fp8InputError
from fp8route.kernels.pdl import launch_options
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR, tl, triton

BLOCK_N = 64  # positions per tile of the inner loop
_MAX_SPLITS = 64  # the combine kernel reads one row of this many partials


class Launch(NamedTuple):
    """Kernel 1's tiling: positions per tile (a divisor of every split), warps, pipeline stages, for
    an fp8 cache whether its tiles meet q in fp16 rather than q's dtype (e4m3 values are exact in
    both; e4m3 -> fp16 is one conversion instruction on SM89+), the registers a thread may take at
    most (ptxas's maxnreg; 0: ptxas's own choice), and whether a split's block-table entries are
    loaded once before its tiles (table): a tile's K/V addresses then wait on no load of their own,
    and Triton's pipeliner keeps stages - 1 tiles in flight where a load per tile keeps one (sm_90)."""

    block: int = BLOCK_N
    warps: int = 4
    stages: int = 3
    f16: bool = False
    regs: int = 0
    table: bool = False

    @classmethod
    def parse(cls, text: str) -> Launch:
        """BLOCKxWARPSxSTAGES, then h for fp16 tiles, g for the table read once, then -rREGS for a
        register cap: "64x4x3", "128x4x2h", "64x4x3hg-r128" (how benchmarks name them)."""
        tiling, _, regs = text.partition("-r")
        try:
            block, warps, stages = (int(x) for x in tiling.removesuffix("g").removesuffix("h").split("x"))
            cap = int(regs) if regs else 0
        except ValueError:
            shape = "BLOCKxWARPSxSTAGES[h][g][-rREGS] (e.g. 64x4x3, 128x4x2h or 64x4x3hg-r128)"
            raise Fp8InputError(f"a decode launch is {shape}, not {text!r}") from None
        table = tiling.endswith("g")
        return cls(block, warps, stages, tiling.removesuffix("g").endswith("h"), cap, table)

    def __str__(self) -> str:
        cap = f"-r{self.regs}" if self.regs else ""
        return f"{self.block}x{self.warps}x{self.stages}{'h' if self.f16 else ''}{'g' if self.table else ''}{cap}"

    def options(self) -> dict[str, int]:
        """Kernel 1's launch options beyond warps and stages."""
        return {"maxnreg": self.regs} if self.regs else {}


# By whether the cache is fp8. A bf16 cache's step is slower with 128-position tiles (benchmarks/results/h200/fp8_kv/).
# An fp8 cache's e4m3 tiles take ptxas 200-255 registers a thread uncapped: two programs a SM, too few reads in
# flight. Capped at 128 with 64-position tiles, four run a SM, and the batch needs about twice the programs to
# fill them (target_splits); measured over batches and row lengths in benchmarks/results/h100/serve_bound/. The
# table read once a split: 1.01-1.09x for the e4m3 tiles, up to 1.10x for the bf16 ones at short batches
# (benchmarks/results/h100/kv_table/).
LAUNCH = {False: Launch(table=True), True: Launch(64, 4, 3, f16=True, regs=128, table=True)}


class NewToken(NamedTuple):
    """A decode step's new token for decode_attention: its key and value [B, Hkv, D] before RoPE and
    the rows' RoPE tables [B, D] (fp32) at their positions, lengths - 1."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class Pages(NamedTuple):
    """Where the rows' positions live: one layer's K and V blocks [num_blocks, BS, Hkv, D] (unit
    stride on D), the block tables [rows, max_blocks] (int32) and each batch row's table row [B];
    for float8_e4m3fn blocks, the layer's K and V scales (a read is fp8 * scale)."""

    k: torch.Tensor
    v: torch.Tensor
    tables: torch.Tensor
    rows: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def max_len(self) -> int:
        return self.tables.shape[1] * self.k.shape[1]


# The deterministic mode's positions per split (paged_attention's decode_split): fixed, where split_len
# follows the batch; a multiple of every LAUNCH tile. Rows longer than 64 splits of it take longer ones.
FIXED_SPLIT = 256


def split_len(pairs: int = 1) -> int:
    """Positions per program for `pairs` (row, KV head) pairs, at least: 128 for up to 8 pairs (one
    row of Llama-3.1-8B), twice that for each 4x more pairs (sqrt(pairs / 8), rounded up to a power
    of two); a row longer than 64 of them takes longer splits (in the kernel). Measured on the H200
    over 8192 positions (benchmarks/results/h200/flashinfer_attention/): a row of 16 at 1024 filled
    took 47 us with 128 positions per program, 26 us with 512."""
    scale = 1
    while scale * scale * 8 < pairs:
        scale *= 2
    return 2 * BLOCK_N * scale


# Splits over a small batch's short rows: about this many (row, KV head, split) programs in all, twice as many
# for a launch capped to run four programs a SM.
_SHORT_ROW_PROGRAMS = 256


def target_splits(pairs: int, launch: Launch) -> int:
    """Splits a row is cut into at most before they grow past the launch's tile, for `pairs` (row, KV
    head) pairs; 0 where split_len's alone. Uncapped: about _SHORT_ROW_PROGRAMS programs over the batch,
    from up to 32 pairs (4 rows of Llama-3.1-8B); capped (launch.regs): twice the programs, over up to
    _SHORT_ROW_PROGRAMS pairs (32 rows). Swept in benchmarks/results/h100/serve_bound/."""
    if launch.regs:
        return min(_MAX_SPLITS, 2 * _SHORT_ROW_PROGRAMS // pairs) if pairs <= _SHORT_ROW_PROGRAMS else 0
    if pairs > _SHORT_ROW_PROGRAMS // 8:
        return 0
    return min(_MAX_SPLITS, _SHORT_ROW_PROGRAMS // pairs)


def programs_for(pairs: int, num_splits: int, sms: int) -> int:
    """Programs per (row, KV head): enough for four waves of the SMs over all `pairs`, each running
    every programs-th split of its row, at most one per split. The grid then follows the batch, not
    the table's width: tables 131072 positions wide cost the e4m3 cache 1.5x at batch 256 with one
    program per split, and nothing with these (an H100, rows of 512-2048:
    benchmarks/results/h100/serve_bound)."""
    return min(num_splits, max(1, -(-4 * sms // pairs)))


if TRITON_IMPORT_ERROR is None:
    from fp8route.kernels.pdl import wait_for_inputs

    @triton.jit
    def _row_split(
        length, SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr, TARGET: tl.constexpr
    ):  # fmt: skip
        """A row's positions per program: SPLIT, or whole tiles enough to cover it in MAX_SPLITS; with a
        TARGET, a row short enough takes fewer (whole tiles for TARGET splits, one tile at least)."""
        whole = ((length + MAX_SPLITS * BLOCK - 1) // (MAX_SPLITS * BLOCK)) * BLOCK
        size = tl.maximum(SPLIT, whole)
        if TARGET > 0:
            fit = ((length + TARGET * BLOCK - 1) // (TARGET * BLOCK)) * BLOCK
            size = tl.maximum(tl.maximum(whole, BLOCK), tl.minimum(SPLIT, fit))
        return size

    @triton.jit
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, tab_ptr, row_ptr, len_ptr, o_ptr, lse_ptr, nk_ptr, nv_ptr, cos_ptr, sin_ptr,
        stride_qb, stride_qh,
        stride_kblk, stride_ks, stride_kh,
        stride_vblk, stride_vs, stride_vh,
        stride_tab,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh,
        stride_nkb, stride_nkh, stride_nvb, stride_nvh, stride_cb,
        sm_scale, k_scale, v_scale, k_inv, v_inv,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
        SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr, TARGET: tl.constexpr,
        PRECISION: tl.constexpr, NEW: tl.constexpr, FP8: tl.constexpr, F16: tl.constexpr, TAB: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):  # fmt: skip
        wait_for_inputs(USE_PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        first, programs = tl.program_id(2), tl.num_programs(2)  # this program runs splits first, + programs, ...
        length = tl.load(len_ptr + b).to(tl.int32)
        table = tab_ptr + tl.load(row_ptr + b).to(tl.int64) * stride_tab
        size = _row_split(length, SPLIT, MAX_SPLITS, BLOCK, TARGET)

        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        g_mask = g < G
        d_mask = d < D
        heads = kvh * G + g
        q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
        q = tl.load(q_rows + d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if NEW:  # D is a power of two here: D_PAD == D
            # RoPE, the head's halves as pairs: x * cos + (-x[d + D/2] | x[d - D/2]) * sin.
            partner = tl.where(d < D // 2, d + D // 2, d - D // 2)
            sign = tl.where(d < D // 2, -1.0, 1.0)
            cos = tl.load(cos_ptr + b * stride_cb + d)
            sin = tl.load(sin_ptr + b * stride_cb + d)
            q_pair = tl.load(q_rows + partner[None, :], mask=g_mask[:, None], other=0.0)
            q = (q.to(tl.float32) * cos + sign * q_pair.to(tl.float32) * sin).to(q_ptr.dtype.element_ty)
            pos = length - 1
            if (pos // size) % programs == first:  # one of this program's splits holds the new position
                block = tl.load(table + pos // PAGE).to(tl.int64)
                k_row = nk_ptr + b * stride_nkb + kvh * stride_nkh
                k_new = tl.load(k_row + d).to(tl.float32) * cos + sign * tl.load(k_row + partner).to(tl.float32) * sin
                k_at = k_ptr + block * stride_kblk + (pos % PAGE) * stride_ks + kvh * stride_kh
                v_at = v_ptr + block * stride_vblk + (pos % PAGE) * stride_vs + kvh * stride_vh
                v_new = tl.load(nv_ptr + b * stride_nvb + kvh * stride_nvh + d)
                if FP8:
                    k_new = k_new.to(nk_ptr.dtype.element_ty).to(tl.float32) * k_inv
                    v_new = v_new.to(tl.float32) * v_inv
                    k_new = tl.minimum(tl.maximum(k_new, -448.0), 448.0)
                    v_new = tl.minimum(tl.maximum(v_new, -448.0), 448.0)
                tl.store(k_at + d, k_new.to(k_ptr.dtype.element_ty))
                tl.store(v_at + d, v_new.to(v_ptr.dtype.element_ty))
            tl.debug_barrier()  # the writes above before any thread's read of that position
        # exp2 with log2(e) folded into the scale: one multiply fewer per score.
        qk_scale = sm_scale * 1.4426950408889634
        if FP8:
            qk_scale = qk_scale * k_scale
        if F16:
            q = q.to(tl.float16)
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        for split in range(first, (length + size - 1) // size, programs):
            _attend_split(
                q, table, k_head, v_head, o_ptr, lse_ptr, b, heads, g_mask, d, d_mask, split * size,
                tl.minimum(split * size + size, length), split, qk_scale, v_scale,
                stride_kblk, stride_ks, stride_vblk, stride_vs, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                G_PAD, D_PAD, PAGE, BLOCK, PRECISION, FP8, TAB,
            )  # fmt: skip

    @triton.jit
    def _attend_split(
        q, table, k_head, v_head, o_ptr, lse_ptr, b, heads, g_mask, d, d_mask, start, end, split, qk_scale, v_scale,
        stride_kblk, stride_ks, stride_vblk, stride_vs, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
        G_PAD: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
        PRECISION: tl.constexpr, FP8: tl.constexpr, TAB: tl.constexpr,
    ):  # fmt: skip
        """One split of a row's positions [start, end) for its KV head's query heads: the online softmax
        over its tiles, then its normalized output and log-sum-exp stored at index split."""
        m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        s_sum = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        if TAB:  # the split's table entries, once: each tile's addresses then need no load of its own
            first_page = start // PAGE
            pages = first_page + tl.arange(0, TAB)
            entries = tl.load(table + pages, mask=pages * PAGE < end, other=0)
        for n0 in range(start, end, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            n_mask = n < end
            if TAB:  # & keeps a tile past the split's end (loads masked, addresses still computed) in entries
                blocks = tl.gather(entries, (n // PAGE - first_page) & (TAB - 1), 0).to(tl.int64)
            else:
                blocks = tl.load(table + n // PAGE, mask=n_mask, other=0).to(tl.int64)
            within = n % PAGE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k_at = k_head + blocks * stride_kblk + within * stride_ks
            k = tl.load(k_at[:, None] + d[None, :], mask=kv_mask, other=0.0)
            k = k.to(q.dtype)  # e4m3, or a 16-bit cache under fp32 queries (a no-op when they match)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            v_at = v_head + blocks * stride_vblk + within * stride_vs
            v = tl.load(v_at[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            s_sum = s_sum * alpha + tl.sum(p, 1)
            m = m_new
        out = acc / s_sum[:, None]
        if FP8:
            out = out * v_scale
        lse = m + tl.log2(s_sum)  # base 2, like m
        tl.store(
            o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
            out,
            mask=g_mask[:, None] & d_mask[None, :],
        )
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)

    @triton.jit
    def _combine_kernel(
        o_ptr, lse_ptr, len_ptr, out_ptr,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh,
        stride_rb, stride_rh,
        SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr, TARGET: tl.constexpr,
        S_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        wait_for_inputs(USE_PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        length = tl.load(len_ptr + b).to(tl.int32)
        size = _row_split(length, SPLIT, MAX_SPLITS, BLOCK, TARGET)
        splits = (length + size - 1) // size
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        s_mask = s < splits
        lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))
        w = tl.where(s_mask, w, 0.0)
        o = tl.load(
            o_ptr + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
            mask=s_mask[:, None] & (d < D)[None, :],
            other=0.0,
        )
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + b * stride_rb + h * stride_rh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def fuses_new_token(q: torch.Tensor, new: NewToken) -> bool:
    """Whether decode_attention can take this new token (else: RoPE and the cache write first, then
    decode_attention without it): a power-of-two head size of 16 or more, unit stride on it everywhere."""
    b, _, d = q.shape
    tensors = (q, new.k, new.v, new.cos, new.sin)
    unit = all(t.stride(-1) == 1 for t in tensors) and new.cos.stride() == new.sin.stride()
    shapes = new.k.shape == new.v.shape and new.k.shape[::2] == (b, d) and new.cos.shape == new.sin.shape == (b, d)
    return d >= 16 and d & (d - 1) == 0 and unit and shapes


def decode_attention(
    q: torch.Tensor,
    pages: Pages,
    lengths: torch.Tensor,
    scale: float | None = None,
    split: int | None = None,
    new: NewToken | None = None,
    launch: Launch | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """q [B, H, D] (one token per row) over the first lengths[b] positions (each 1..the table's
    reach) of the row pages.rows[b] -> [B, H, D] in q's dtype. split (the least positions per
    split, a multiple of BLOCK_N and of the launch's tile; default split_len), launch (default
    LAUNCH's for the cache's dtype) and programs (per row and KV head,
    each running every programs-th split of its row; default programs_for) are for benchmarks: none
    changes the result.
    With `new` (fuses_new_token), q is before RoPE, and the new key (rotated) and value are written
    at position lengths[b] - 1 first."""
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    fp8 = _check_pages(q, pages)
    hkv = pages.k.shape[2]
    pairs = q.shape[0] * hkv
    launch = launch or LAUNCH[fp8]
    target = 0 if split else target_splits(pairs, launch)
    split = split or split_len(pairs)
    if split % BLOCK_N or split < BLOCK_N or split % launch.block:
        raise Fp8InputError(
            f"decode_attention: split {split} must be a positive multiple of {BLOCK_N} and of the tile, {launch.block}"
        )
    num_splits = min(_MAX_SPLITS, max(triton.cdiv(pages.max_len, split), min(target, pages.max_len // launch.block)))
    programs = programs or programs_for(pairs, num_splits, launch_sms(q.device))
    if not 1 <= programs <= num_splits:
        raise Fp8InputError(f"decode_attention: programs {programs} must be 1 to a row's splits here, {num_splits}")
    if new is not None and (not fuses_new_token(q, new) or new.k.shape[1] != hkv):
        raise Fp8InputError("decode_attention: this new token cannot be fused (see fuses_new_token)")
    partial, lse = _split_pass(q, pages, lengths, scale, split, target, num_splits, programs, new, launch)
    return _combine_pass(q, partial, lse, lengths, split, target, launch)


def _check_pages(q: torch.Tensor, pages: Pages) -> bool:
    """Refuse q and K/V blocks that do not fit each other; whether the cache is fp8."""
    b, h, d = q.shape
    k, v, _, rows, k_scale, v_scale = pages
    _, page, hkv, _ = k.shape
    if h % hkv != 0 or k.shape[-1] != d or v.shape != k.shape or rows.shape != (b,) or page & (page - 1):
        raise Fp8InputError(
            f"decode_attention: q {tuple(q.shape)} does not fit K/V blocks {tuple(k.shape)} / {tuple(v.shape)} "
            f"and rows {tuple(rows.shape)} (need H a multiple of Hkv, the same D, one row each, power-of-two pages)"
        )
    fp8 = k.dtype == torch.float8_e4m3fn
    if (fp8 or v.dtype == torch.float8_e4m3fn) and (v.dtype != k.dtype or not (k_scale > 0 and v_scale > 0)):
        raise Fp8InputError(
            f"decode_attention: K/V blocks {k.dtype} / {v.dtype} with scales {k_scale} / {v_scale} (an fp8 cache "
            "needs both blocks float8_e4m3fn and positive scales)"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise Fp8InputError("decode_attention: q and the K/V blocks need unit stride on the head dim")
    return fp8


def _pad(n: int) -> int:
    """n rounded up to a power of two of at least 16: a tl.dot / tl.arange dimension."""
    return max(16, triton.next_power_of_2(n))


def _split_pass(
    q: torch.Tensor, pages: Pages, lengths: torch.Tensor, scale: float | None, split: int, target: int,
    num_splits: int, programs: int, new: NewToken | None, launch: Launch,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Kernel 1: each split's normalized output [B, H, num_splits, D] and log-sum-exp [B, H, num_splits], fp32."""
    b, h, d = q.shape
    k, v, tables, rows, k_scale, v_scale = pages
    _, page, hkv, _ = k.shape
    fp8 = k.dtype == torch.float8_e4m3fn
    group = h // hkv
    partial = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    nk, nv, cos, sin = new if new is not None else (q, q, lse, lse)  # unread without NEW
    _split_kernel[(b, hkv, programs)](
        q, k, v, tables, rows, lengths, partial, lse, nk, nv, cos, sin,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        nk.stride(0), nk.stride(1), nv.stride(0), nv.stride(1), cos.stride(0),
        scale if scale is not None else d**-0.5, k_scale, v_scale, 1.0 / k_scale, 1.0 / v_scale,
        G=group, G_PAD=_pad(group), D=d, D_PAD=_pad(d), PAGE=page,
        SPLIT=split, MAX_SPLITS=num_splits, BLOCK=launch.block, TARGET=target, NEW=new is not None, FP8=fp8,
        F16=fp8 and launch.f16 and q.dtype != torch.float32, TAB=_table_entries(pages, split, num_splits, launch),
        # An fp32 cache asks for fp32 products (tl.dot would round them to TF32); 16-bit ones are exact.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=launch.warps, num_stages=launch.stages, **launch.options(), **launch_options(),
    )  # fmt: skip
    return partial, lse


def _table_entries(pages: Pages, split: int, num_splits: int, launch: Launch) -> int:
    """Launch.table's entries a program reads once: a split's pages (at most _row_split's size), one more
    for a split starting inside a page, as a power of two; 0 without it."""
    if not launch.table:
        return 0
    longest = min(pages.max_len, max(split, triton.cdiv(pages.max_len, num_splits * launch.block) * launch.block))
    return triton.next_power_of_2(triton.cdiv(longest, pages.k.shape[1]) + 1)


def _combine_pass(
    q: torch.Tensor,
    partial: torch.Tensor,
    lse: torch.Tensor,
    lengths: torch.Tensor,
    split: int,
    target: int,
    launch: Launch,
) -> torch.Tensor:
    """Kernel 2: each row's valid splits combined -> [B, H, D] in q's dtype."""
    b, h, num_splits, d = partial.shape
    out = torch.empty_like(q)
    _combine_kernel[(b, h)](
        partial, lse, lengths, out,
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        SPLIT=split, MAX_SPLITS=num_splits, BLOCK=launch.block, TARGET=target, S_PAD=_pad(num_splits),
        D=d, D_PAD=_pad(d), num_warps=4, **launch_options(),
    )  # fmt: skip
    return out
