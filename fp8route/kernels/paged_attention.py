"""Causal attention of a flat batch of query tokens from any number of sequences over the paged KV cache.

Sequence i's queries are tokens cu_q[i] .. cu_q[i+1] - 1 of q [T, H, D]: the last q_len of its
lengths[i] positions, all of them already in the cache, in the blocks table row rows[i] lists. Query
j sees positions 0 .. lengths[i] - q_len + j. So one call serves decode rows (one query), fresh prompt
chunks and chunks continuing a cached prefix alike: a serving step's whole batch, per layer.

It runs two grids of one kernel over disjoint sequences, so that a row's result depends on its own
sequence only, never on the rest of the batch:
- one-query sequences (decode rows, listed first) split their positions into segments sized from
  their own length (at least SPLIT_MIN positions, at most MAX_SPLITS segments), one program per
  (sequence, KV head, segment); a second kernel merges a row's segments by their log-sum-exp;
- the others cut their queries into blocks of BLOCK_Q tokens from their own start; one program per
  (block, KV head) takes the G query heads sharing the KV head for each token (BLOCK_M = BLOCK_Q * G
  rows for tl.dot) and streams the positions the block's last token sees, TILE at a time, with an
  fp32 online softmax. A block finds its sequence by binary search over cu_q.

Cached K and V meet q in q's dtype for tl.dot: an fp8 cache (float8_e4m3fn blocks, one scale per
tensor) is converted exactly, the key's scale folded into the score scale and the value's into the
output. Offsets into the cache are int64. Every length is read on the device and the grids follow
from the token and sequence counts: a CUDA graph can capture a call of fixed counts. With the counts
on the device too (Sequences.counts), the grids follow from bounds and the programs past the step's
sequences exit: a graph captured once serves every step within the bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fp8route.errors import Fp8InputError
from fp8route.kernels import paged_decode
from fp8route.kernels.launcher import DirectLauncher, int_key
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR, tl, triton

TILE = 64  # positions per step of the one-query grid's inner loop
SPLIT_MIN = 256  # a one-query sequence's segment holds at least this many positions
MAX_SPLITS = 16


class Launch(NamedTuple):
    """The multi-query grid's tiling: query rows and positions per step, warps, pipeline stages. The
    default measured fastest at both 2048 and 8192 fresh tokens among the tilings swept (8B heads,
    bf16: benchmarks/results/h200/engine/, benchmarks/results/h100/serve_bound/)."""

    block_m: int = 128
    tile: int = 128
    warps: int = 8
    stages: int = 3


MULTI = Launch()
# The one-query grid's launch by whether the cache is fp8: paged_decode's, whose fp16 tiles, register cap and
# table read once a segment mean the same here; its tile is always TILE. For e4m3 tiles the three together read
# 1.35-1.79x faster (benchmarks/results/h100/kv_table/); a bf16 cache's gain only on long rows.
ONE_QUERY = {
    False: paged_decode.Launch(TILE, 4, 3),
    True: paged_decode.Launch(TILE, 4, 3, f16=True, regs=128, table=True),
}
_LOG2E = 1.4426950408889634


class PagedKV(NamedTuple):
    """One layer's K and V blocks [num_blocks, page, Hkv, D] (unit stride on D), the block tables
    [rows, max_blocks] (int32), and for float8_e4m3fn blocks the K and V scales (a read is fp8 * scale)."""

    k: torch.Tensor
    v: torch.Tensor
    tables: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(frozen=True)
class Sequences:
    """How q's tokens split into sequences. On q's device: cu_q [S + 1] (int32, query offsets),
    lengths [S] (int32, positions each sequence has after this step), rows [S] (table rows). On the
    host: how many sequences lead with one query each.

    counts (int32 [2] on q's device: the one-query sequences, then all of them): the step's counts are
    read there, and S and singles are bounds (a captured graph's): entries past counts[1] are never read."""

    cu_q: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor
    singles: int
    counts: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return self.lengths.shape[0]


def splits_for(length: int) -> tuple[int, int]:
    """A one-query sequence of this many positions: (segments, positions per segment), as the kernel
    computes them (for tests and benchmarks; the kernel never asks the host)."""
    count = min(max(_cdiv(length, SPLIT_MIN), 1), MAX_SPLITS)
    size = _cdiv(_cdiv(length, count), TILE) * TILE
    return _cdiv(length, size), size


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_m_for(group: int, dtype: torch.dtype, launch: Launch = MULTI) -> int:
    """Query rows per program of the multi-query grid: the launch's (32 for fp32, whose tiles take twice
    the registers), or the group's power of two when larger. Fixed by the model, never by the batch: a
    block's tokens, and so its rows' results, depend on their own sequence alone."""
    return max(32 if dtype == torch.float32 else launch.block_m, _pow2_at_least(group))


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def paged_attention(
    q: torch.Tensor,
    cache: PagedKV,
    seqs: Sequences,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    launch: Launch = MULTI,
    decode_split: int | None = None,
    one_query: paged_decode.Launch | None = None,
) -> torch.Tensor:
    """q [T, H, D] (after RoPE; unit stride on D) attending causally over its sequences' cached
    positions -> [T, H, D] in q's dtype (into out when given), by the Triton kernels (on CUDA, or on
    a CPU under Triton's interpreter; paged_attention_reference is the torch path). launch and
    one_query: the multi-query and one-query grids' tilings (for benchmarks; one_query defaults to
    ONE_QUERY's for the cache's dtype). decode_split: the one-query sequences through the decode
    kernel (fp8route.kernels.paged_decode) with this many positions per split instead of the one-query
    grid: a split fixed by no batch, so a row's result still depends on its own length alone."""
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    t, h, d = q.shape
    k, v, tables, k_scale, v_scale = cache
    hkv = k.shape[2]
    group = h // hkv
    fp8 = k.dtype == torch.float8_e4m3fn
    if one_query is None:
        one_query = ONE_QUERY[fp8]
    elif one_query.block != TILE:  # a benchmark's launch; the defaults' tile is TILE
        raise Fp8InputError(f"paged_attention: the one-query grid's tile is {TILE} positions, not {one_query.block}")
    out = torch.empty_like(q) if out is None else out
    qk_scale = (d**-0.5 if scale is None else scale) * _LOG2E * (k_scale if fp8 else 1.0)
    common = {
        "G": group, "D": d, "D_PAD": max(16, triton.next_power_of_2(d)), "PAGE": k.shape[1],
        "SPLIT_MIN": SPLIT_MIN, "FP8": fp8,
        # fp32 tensors ask for fp32 products (tl.dot would round them to TF32); 16-bit ones are exact.
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }  # fmt: skip
    singles, rest = seqs.singles, seqs.count - seqs.singles
    counted = seqs.counts is not None
    if counted:
        if decode_split is not None:
            raise Fp8InputError(
                "paged_attention: decode_split takes the step's counts on the host, not in Sequences.counts"
            )
        rest = seqs.count  # a bound: every sequence may be a multi-query one
    if singles and decode_split is not None:
        pages = paged_decode.Pages(k, v, tables, seqs.rows[:singles], k_scale, v_scale)
        out[:singles] = paged_decode.decode_attention(
            q[:singles], pages, seqs.lengths[:singles], scale, split=decode_split
        )
    elif singles:
        _singles(q, cache, seqs, out, qk_scale, v_scale, common, one_query)
    if rest:
        block_m = block_m_for(group, q.dtype, launch)
        block_q = block_m // group
        if counted:  # the kernel finds where the multi-query sequences start, and how many
            grid = (t // block_q + rest, hkv, 1)
            args = _args(q, cache, seqs.cu_q, seqs.lengths, seqs.rows, out, out, out, rest, seqs.counts)
        else:
            grid = ((t - singles) // block_q + rest, hkv, 1)
            tail = seqs.cu_q[singles:], seqs.lengths[singles:], seqs.rows[singles:]
            args = _args(q, cache, *tail, out, out, out, rest)
        meta = {
            **common, "TILE": launch.tile, "BLOCK_M": block_m, "BLOCK_Q": block_q, "SPLITS": 1, "COUNTED": counted,
            "F16": False, "TAB": 0,
        }  # fmt: skip
        _ATTENTION(grid, _key(args), (*args, qk_scale, v_scale), {**meta, "num_warps": launch.warps,
                                                                  "num_stages": launch.stages})  # fmt: skip
    return out


def _singles(
    q: torch.Tensor, cache: PagedKV, seqs: Sequences, out: torch.Tensor, qk_scale: float, v_scale: float, common: dict,
    launch: paged_decode.Launch,
) -> None:  # fmt: skip
    """The one-query sequences: segments, then their merge."""
    h, d = q.shape[1], q.shape[2]
    n = seqs.singles
    group = common["G"]
    block_m = max(16, _pow2_at_least(group))
    partial = torch.empty((n, h, MAX_SPLITS, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((n, h, MAX_SPLITS), dtype=torch.float32, device=q.device)
    cu_q = seqs.cu_q[: n + 1]
    counted = seqs.counts is not None
    args = _args(q, cache, cu_q, seqs.lengths[:n], seqs.rows[:n], out, partial, lse, n, seqs.counts)
    meta = {**common, "TILE": TILE, "BLOCK_M": block_m, "BLOCK_Q": block_m // group, "SPLITS": MAX_SPLITS,
            "COUNTED": counted, "F16": common["FP8"] and launch.f16 and q.dtype != torch.float32,
            "TAB": _table_entries(cache) if launch.table else 0}  # fmt: skip
    grid = (n, cache.k.shape[2], MAX_SPLITS)
    options = {"num_warps": launch.warps, "num_stages": launch.stages, **launch.options()}
    _ATTENTION(grid, _key(args), (*args, qk_scale, v_scale), {**meta, **options})
    counts = seqs.counts if counted else lse  # unread when not counted
    merge = (partial, lse, cu_q, seqs.lengths[:n], out, counts,
             *partial.stride()[:3], *lse.stride()[:2], *out.stride()[:2])  # fmt: skip
    meta = {"D": d, "D_PAD": common["D_PAD"], "TILE": TILE, "SPLIT_MIN": SPLIT_MIN, "SPLITS": MAX_SPLITS,
            "COUNTED": counted}  # fmt: skip
    _MERGE((n, h), _key(merge, pointers=6), merge, {**meta, "num_warps": 4})


def _table_entries(cache: PagedKV) -> int:
    """The table entries a one-query segment spans at most, read once when its launch asks (Launch.table):
    the longest segment a row of the table's reach is cut into, one more for a segment starting inside a
    page, as a power of two."""
    page = cache.k.shape[1]
    # A row's segments hold at most SPLIT_MIN positions up to MAX_SPLITS of them, more (growing) above.
    size = max(SPLIT_MIN, splits_for(cache.tables.shape[1] * page)[1])
    return triton.next_power_of_2(_cdiv(size, page) + 1)


def _args(q: torch.Tensor, cache: PagedKV, cu_q: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
          out: torch.Tensor, partial: torch.Tensor, lse: torch.Tensor, count: int,
          counts: torch.Tensor | None = None) -> tuple:  # fmt: skip
    """The kernel's arguments in its order: pointers (counts: the device counts, else an unread one),
    the sequence count (a bound with counts), strides."""
    k, v, tables = cache.k, cache.v, cache.tables
    return (
        q, k, v, tables, rows, cu_q, lengths, out, partial, lse, counts if counts is not None else lengths,
        count,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        tables.stride(0), out.stride(0), out.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(-2) if partial.dim() == 4 else 0,
        lse.stride(0), lse.stride(1) if lse.dim() == 3 else 0,
    )  # fmt: skip


def _key(args: tuple, pointers: int = 11) -> tuple:
    """What the kernel is specialized on: the tensors' dtypes and the integers' classes."""
    return (*(a.dtype for a in args[:pointers]), *int_key(*args[pointers:]))


def paged_attention_reference(
    q: torch.Tensor, cache: PagedKV, seqs: Sequences, scale: float | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """paged_attention in torch: each sequence's positions gathered through its table row, dequantized,
    and SDPA with the causal mask aligned to the sequence's end; one call for the one-query sequences
    and one per power-of-two query length among the rest. Reads the layout back to the host."""
    cu = seqs.cu_q.tolist()
    lengths = seqs.lengths.tolist()
    out = torch.empty_like(q) if out is None else out
    starts, queries = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
    classes: dict[int, list[int]] = {}
    for i, n in enumerate(queries):
        classes.setdefault(1 if n == 1 else _pow2_at_least(n), []).append(i)
    for width, members in classes.items():
        index = torch.tensor(members, device=q.device)
        n_q = torch.tensor([queries[i] for i in members], device=q.device)
        n_kv = torch.tensor([lengths[i] for i in members], device=q.device)
        reach = max(lengths[i] for i in members)
        k, v = _gather(cache, seqs.rows[index], n_kv, reach, q.dtype)  # [S, Hkv, reach, D]
        slot = torch.arange(width, device=q.device)
        tokens = torch.tensor([starts[i] for i in members], device=q.device)[:, None] + slot  # [S, width]
        real = slot[None, :] < n_q[:, None]
        tokens = torch.where(real, tokens, 0)
        q_i = q[tokens].transpose(1, 2)  # [S, H, width, D]
        sees = (n_kv - n_q)[:, None] + slot[None, :]  # the last position each query sees
        visible = torch.arange(reach, device=q.device)[None, None, :] <= sees[:, :, None]
        o = F.scaled_dot_product_attention(q_i, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=True)
        o = o.transpose(1, 2)[real]  # [real tokens, H, D]
        out[tokens[real]] = o.to(out.dtype)
    return out


def paged_attention_rows(q: torch.Tensor, cache: PagedKV, seqs: Sequences, scale: float | None = None) -> torch.Tensor:
    """paged_attention in torch, each query alone over exactly the positions it sees: the same
    arithmetic whatever else the step holds and however the prompt was chunked (the deterministic
    mode's attention; one SDPA call per query, so meant for CPUs). Reads the layout back to the host."""
    cu, lengths = seqs.cu_q.tolist(), seqs.lengths.tolist()
    out = torch.empty_like(q)
    for i, length in enumerate(lengths):
        first, queries = cu[i], cu[i + 1] - cu[i]
        k, v = _gather(cache, seqs.rows[i : i + 1], seqs.lengths[i : i + 1], length, q.dtype)  # [1, Hkv, L, D]
        for j in range(queries):
            sees = length - queries + j + 1
            row = q[first + j][None, :, None]  # [1, H, 1, D]
            o = F.scaled_dot_product_attention(row, k[:, :, :sees], v[:, :, :sees], scale=scale, enable_gqa=True)
            out[first + j] = o[0, :, 0].to(out.dtype)
    return out


def _gather(
    cache: PagedKV, rows: torch.Tensor, lengths: torch.Tensor, reach: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `reach` positions of each row's K and V, [S, Hkv, reach, D] in dtype, zero past the
    row's length (a block's unwritten tail may hold anything, and a masked NaN still poisons p @ V)."""
    page = cache.k.shape[1]
    blocks = cache.tables[rows, : -(-reach // page)].long()
    k, v = (x[blocks].flatten(1, 2)[:, :reach].transpose(1, 2) for x in (cache.k, cache.v))
    if k.dtype == torch.float8_e4m3fn:
        k, v = k.to(torch.float32) * cache.k_scale, v.to(torch.float32) * cache.v_scale
    filled = (torch.arange(reach, device=k.device)[None, :] < lengths[:, None])[:, None, :, None]
    return torch.where(filled, k.to(dtype), 0), torch.where(filled, v.to(dtype), 0)


if TRITON_IMPORT_ERROR is None:
    from fp8route.kernels.pdl import wait_for_inputs

    @triton.jit
    def _segments(length, SPLIT_MIN: tl.constexpr, SPLITS: tl.constexpr, TILE: tl.constexpr):
        """A one-query row's (segments, positions per segment), from its own length alone."""
        count = tl.minimum(tl.maximum((length + SPLIT_MIN - 1) // SPLIT_MIN, 1), SPLITS)
        size = ((length + count - 1) // count + TILE - 1) // TILE * TILE
        return (length + size - 1) // size, size

    @triton.jit
    def _sequence_of(cu_ptr, block, count, BLOCK_Q: tl.constexpr):
        """The sequence whose query blocks hold `block`: sequence i's start at (cu_q[i] - cu_q[0]) //
        BLOCK_Q + i, which leaves room for its cdiv(q_len, BLOCK_Q) blocks."""
        base = tl.load(cu_ptr)
        lo = 0
        hi = count
        while lo < hi:
            mid = (lo + hi) // 2
            if (tl.load(cu_ptr + mid) - base) // BLOCK_Q + mid <= block:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _tile(
        q, acc, m_i, l_i, n0, end, sees, table, entries, first_page, k_head, v_head, d, d_ok,
        stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
        PAGE: tl.constexpr, TILE: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr,
        TAB: tl.constexpr,
    ):  # fmt: skip
        """One tile of positions n0 .. n0 + TILE - 1 into the online softmax; MASKED: some of them lie
        at or past `end`, or past what a row sees. With TAB, the tile's blocks come from entries (the
        table from page first_page on, loaded once), else from a load of the table of their own."""
        pos = n0 + tl.arange(0, TILE)
        if TAB:  # & keeps a tile past the segment's end (loads masked, addresses still computed) in entries
            blocks = tl.gather(entries, (pos // PAGE - first_page) & (TAB - 1), 0).to(tl.int64)
        if MASKED:
            pos_ok = pos < end
            if not TAB:
                blocks = tl.load(table + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
            kv_ok = pos_ok[:, None] & d_ok[None, :]
        else:
            if not TAB:
                blocks = tl.load(table + pos // PAGE).to(tl.int64)
            kv_ok = d_ok[None, :]
        within = pos % PAGE
        k_at = k_head + blocks[:, None] * stride_kb + within[:, None] * stride_ks + d[None, :]
        v_at = v_head + blocks[:, None] * stride_vb + within[:, None] * stride_vs + d[None, :]
        k = tl.load(k_at, mask=kv_ok, other=0.0) if MASKED or not EVEN_D else tl.load(k_at)
        # The scale applies to each row's maximum, then to the scores in one multiply-add with the offset.
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        if MASKED:
            s = tl.where(pos_ok[None, :] & (pos[None, :] <= sees[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        # Masked, a row that has seen nothing yet (or never will: a padding row) keeps a finite offset;
        # unmasked, every row sees the whole tile, so its maximum is finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
        p = tl.exp2(s * qk_scale - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(v_at, mask=kv_ok, other=0.0) if MASKED or not EVEN_D else tl.load(v_at)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=PRECISION)
        return acc, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def _attention_kernel(
        q_ptr, k_ptr, v_ptr, tab_ptr, row_ptr, cu_ptr, len_ptr, o_ptr, part_ptr, lse_ptr, counts_ptr,
        count,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_tab, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
        qk_scale, v_scale,
        G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr,
        SPLIT_MIN: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, SPLITS: tl.constexpr, COUNTED: tl.constexpr,
        F16: tl.constexpr, TAB: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        wait_for_inputs(USE_PDL)
        kvh = tl.program_id(1)
        if COUNTED:  # count is a bound: the step's counts are on the device
            singles = tl.load(counts_ptr)
            if SPLITS == 1:  # the multi-query sequences follow the one-query ones
                cu_ptr += singles
                len_ptr += singles
                row_ptr += singles
                count = tl.load(counts_ptr + 1) - singles
                if count <= 0:
                    return
            else:
                if tl.program_id(0) >= singles:
                    return
        if SPLITS == 1:
            # The last blocks first: under the causal mask they see the most positions, so the grid's
            # longest programs start in its first wave rather than trail in its last.
            block = tl.num_programs(0) - 1 - tl.program_id(0)
            seq = _sequence_of(cu_ptr, block, count, BLOCK_Q)
            local = block - ((tl.load(cu_ptr + seq) - tl.load(cu_ptr)) // BLOCK_Q + seq)
        else:
            seq = tl.program_id(0)
            local = 0
        first = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - first
        if local * BLOCK_Q >= q_len:
            return
        length = tl.load(len_ptr + seq)
        context = length - q_len
        if SPLITS == 1:
            start = 0
            end = tl.minimum(context + (local + 1) * BLOCK_Q, length)
        else:
            segments, size = _segments(length, SPLIT_MIN, SPLITS, TILE)
            split = tl.program_id(2)
            if split >= segments:
                return
            start = split * size
            end = tl.minimum(start + size, length)

        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        tok = local * BLOCK_Q + m // G  # each row's query within its sequence
        heads = kvh * G + m % G
        live = (m // G < BLOCK_Q) & (tok < q_len)
        d_ok = d < D
        at = (first + tok).to(tl.int64)
        q = tl.load(q_ptr + at[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=live[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        if F16:  # an fp8 cache's tiles meet q in fp16, one conversion from e4m3 (exact in either)
            q = q.to(tl.float16)
        sees = context + tok  # the last position each row sees
        table = tab_ptr + tl.load(row_ptr + seq).to(tl.int64) * stride_tab
        first_page = start // PAGE
        entries = table  # unread without TAB
        if TAB:  # the segment's table entries, once: a tile's addresses then wait on no load of their own
            pages = first_page + tl.arange(0, TAB)
            entries = tl.load(table + pages, mask=pages * PAGE < end, other=0)
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        # Tiles every row sees whole (below the block's first query's position) go without masks; the
        # rest (the causal diagonal, a segment's or the length's ragged end) with them.
        whole = tl.maximum(start + (tl.minimum(context + local * BLOCK_Q + 1, end) - start) // TILE * TILE, start)
        for n0 in range(start, whole, TILE):
            acc, m_i, l_i = _tile(q, acc, m_i, l_i, n0, end, sees, table, entries, first_page, k_head, v_head, d,
                                  d_ok, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                  PAGE, TILE, D == D_PAD, PRECISION, False, TAB)  # fmt: skip
        for n0 in range(whole, end, TILE):
            acc, m_i, l_i = _tile(q, acc, m_i, l_i, n0, end, sees, table, entries, first_page, k_head, v_head, d,
                                  d_ok, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                  PAGE, TILE, D == D_PAD, PRECISION, True, TAB)  # fmt: skip
        result = acc / l_i[:, None]
        if FP8:
            result = result * v_scale
        mask = live[:, None] & d_ok[None, :]
        o_at = o_ptr + at[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        if SPLITS == 1:  # noqa: SIM114 (a static branch: `segments` exists only when SPLITS > 1)
            tl.store(o_at, result.to(o_ptr.dtype.element_ty), mask=mask)
        elif segments == 1:
            tl.store(o_at, result.to(o_ptr.dtype.element_ty), mask=mask)
        else:
            row = seq.to(tl.int64)
            p_at = part_ptr + row * stride_pt + heads[:, None] * stride_ph + split * stride_ps + d[None, :]
            tl.store(p_at, result, mask=mask)
            tl.store(lse_ptr + row * stride_lt + heads * stride_lh + split, m_i + tl.log2(l_i), mask=live)

    @triton.jit
    def _merge_kernel(
        part_ptr, lse_ptr, cu_ptr, len_ptr, o_ptr, counts_ptr,
        stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
        D: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr, SPLIT_MIN: tl.constexpr, SPLITS: tl.constexpr,
        COUNTED: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        wait_for_inputs(USE_PDL)
        seq = tl.program_id(0)
        if COUNTED:  # noqa: SIM102 (a static branch: without it counts_ptr is not a count)
            if seq >= tl.load(counts_ptr):
                return
        h = tl.program_id(1)
        segments, _ = _segments(tl.load(len_ptr + seq), SPLIT_MIN, SPLITS, TILE)
        if segments == 1:  # the attention kernel wrote it
            return
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, D_PAD)
        s_ok = s < segments
        row = seq.to(tl.int64)
        lse = tl.load(lse_ptr + row * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
        w = tl.where(s_ok, tl.exp2(lse - tl.max(lse, 0)), 0.0)
        o = tl.load(part_ptr + row * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=s_ok[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
        result = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        token = tl.load(cu_ptr + seq).to(tl.int64)
        tl.store(o_ptr + token * stride_ot + h * stride_oh + d, result.to(o_ptr.dtype.element_ty), mask=d < D)

    _ATTENTION = DirectLauncher(_attention_kernel, pointers=11, pdl=True)
    _MERGE = DirectLauncher(_merge_kernel, pointers=6, pdl=True)
