"""A GEMM whose every output row is the same bits whatever M is: the deterministic mode's GEMM on a GPU.

    out[m, n] = finish(sum over chunks c, in order, of chunk_c[m, n])
    chunk_c[m, n] = sum over the K steps of chunk c of x[m, k] * w[n, k]   (tl.dot, fp32)

A library GEMM picks its kernel, tiling and split-K by M, so a row's sum is ordered differently in a
batch of 1 and one of 64. Here the tile (BLOCK_M x BLOCK_N, BLOCK_K a step) and the chunking of K
(CHUNK_STEPS steps a chunk) are fixed, and each chunk starts from zero; what M may change is only how
many programs share a tile's chunks. A tile's program sums its chunks in order itself, or, where
there are too few tiles to fill the GPU (small M), each program writes its chunks' sums and the last
of the tile's programs to finish adds them in the same order (fp8route.kernels.split_counters): the
same fp32 additions either way, so the same bits. The finishing scale, bias and rounding are one
function both paths call.

Three ways of scaling (MODE): none (16-bit x and weight: a model's float linears); per row and column
after the sum (the tensor and channel schemes: x's scale a scalar or [M], the weight's a scalar or
[N], each passed with stride 0 when scalar); per 128-wide group inside the sum (the block scheme: x's
[M, ceil(K/128)] and the weight's [ceil(N/128), ceil(K/128)] scales, BLOCK_K = 128). x comes
quantized (its quantizer computes each row from that row alone: fp8route.kernels.quantize), or, for
tilings with quantize_x, in 16 bits to be quantized inside, with a static per-tensor scale or per
1x128 group by the quantizers' own device functions: the same e4m3 codes, so the same bits, without
a kernel of their own and x's round trip through memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any

import torch

from fp8route.device import has_tma, launch_sms
from fp8route.errors import Fp8InputError
from fp8route.kernels.launcher import DirectLauncher, int_key
from fp8route.kernels.split_counters import counters
from fp8route.kernels.triton_support import tl, triton
from fp8route.schemes import BLOCK, cdiv

try:  # Triton's allocator per context, which it gives no getter for
    from triton.runtime._allocation import NullAllocator as _NullAllocator
    from triton.runtime._allocation import _allocator as _TRITON_ALLOCATOR
except ImportError:
    _TRITON_ALLOCATOR = None

NONE, ROWS, BLOCKS = 0, 1, 2  # MODE: how the products are scaled
log = logging.getLogger("fp8route")
_pointer_loads_logged: set[str] = set()  # why TMA tiles loaded by pointers, each logged once


@dataclass(frozen=True)
class FixedTiles:
    """The tiling every M runs with (benchmarks/scripts/fixed_gemm_sweep.py times the candidates)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    chunk_steps: int = 8  # K steps per chunk: a chunk is the unit that programs share
    group_m: int = 8  # tiles of this many token blocks walk the weight's columns together (L2 reuse)
    num_warps: int = 4
    num_stages: int = 3
    # Where the tiles are too few, a split aims for this many programs per SM (0: never split). It costs
    # the chunk sums' round trip through memory, and changes no bits.
    programs_per_sm: int = 2
    # x arrives in 16 bits and each program quantizes its tiles (a static scale, or per 1x128 group):
    # no quantizer launch, but every program converts all BLOCK_M rows of its x tile, padding included,
    # at every K step: at M=1 that doubled the GEMM (benchmarks/results/h100/deterministic).
    quantize_x: bool = False
    # x and weight tiles loaded by the Hopper's tensor memory accelerator (descriptors made in the
    # kernel) instead of per-thread pointer loads: the same operands, so the same bits.
    tma: bool = False

    def as_ints(self) -> list[int]:
        """The fields in order as integers: a custom op's list[int] argument (from_ints reads it back)."""
        return [int(v) for v in astuple(self)]

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> FixedTiles:
        given: dict[str, Any] = {
            f.name: bool(v) if f.type == "bool" else v for f, v in zip(fields(cls), values, strict=True)
        }
        return cls(**given)


TILES = FixedTiles()
# The tilings the deterministic mode chooses from per layer and M bucket, by measurement (a backend each,
# by these names): the best of benchmarks/scripts/fixed_gemm_sweep.py's candidates summed over a model's
# projections at small M, the best at a few hundred rows, a narrow one that won on the shorter
# projections at M <= 256, and a large one loaded through TMA for M in the thousands (its two fp32
# accumulators fill 255 registers and spill 736 bytes with Triton 3.6, more by pointer loads). They share the K
# chunking, so a row gets the same bits from each: the mode may change tiling with M
# (tests/kernels/test_fixed_gemm.py).
TILINGS = {
    "triton_fixed": TILES,
    "triton_fixed_wide": FixedTiles(128, 128, 128, 8, 8, 8, 4, 1),
    "triton_fixed_large": FixedTiles(128, 256, 128, 8, 8, 8, 3, 1, tma=True),
    "triton_fixed_narrow": FixedTiles(64, 64, 128, 8, 8, 4, 4),
    "triton_fixed_quantize": FixedTiles(quantize_x=True),
    "triton_fixed_narrow_quantize": FixedTiles(64, 64, 128, 8, 8, 4, 4, quantize_x=True),
}
_SMEM = 227 * 1024  # Hopper: the shared memory one program may take


if triton is not None:
    from fp8route.kernels.pdl import wait_for_inputs
    from fp8route.kernels.quantize import dynamic_scale, quantize_e4m3
    from fp8route.kernels.tile_order import grouped_tile

    @triton.jit
    def _finish(
        total, out_ptr, bias_ptr, x_scale_ptr, w_scale_ptr, offs_m, offs_n, M, N, stride_om, stride_xs, stride_ws,
        MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):  # fmt: skip
        """Scale (MODE ROWS), add the bias and store: the one place a sum becomes an output."""
        m_mask, n_mask = offs_m < M, offs_n < N
        if MODE == 1:
            x_scale = tl.load(x_scale_ptr + offs_m * stride_xs, mask=m_mask, other=0.0)
            w_scale = tl.load(w_scale_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)
            total = total * (x_scale[:, None] * w_scale[None, :])
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit(do_not_specialize=["M", "chunks_each"])
    def fixed_gemm_kernel(
        x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, bias_ptr, x_scale_ptr, w_scale_ptr,
        M, N, K, stride_xm, stride_wn, stride_om, stride_xs, stride_ws, chunks_each,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_STEPS: tl.constexpr,
        GROUP_M: tl.constexpr, MODE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
        QUANT_X: tl.constexpr, TMA: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        wait_for_inputs(USE_PDL)
        pid, pid_k = tl.program_id(0), tl.program_id(1)
        pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask, n_mask = offs_m < M, offs_n < N
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn  # [BLOCK_K, BLOCK_N] tiles, K-major
        if TMA:  # rows past M or N and columns past K read as zeros, as the masked loads' `other`
            x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_M, BLOCK_K])
            w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [stride_wn, 1], [BLOCK_N, BLOCK_K])

        # One flat loop over this program's K steps, so that the loads pipeline across chunk ends; a
        # chunk's sum is folded in (or written, in a split) at its last step and the next starts from zero.
        steps = tl.cdiv(K, BLOCK_K)
        first = pid_k * chunks_each * CHUNK_STEPS
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if QUANT_X and MODE == 1:  # the static per-tensor scale, as fp8route.kernels.quantize applies it
            static = tl.load(x_scale_ptr)
            static_rcp = tl.math.div_rn(1.0, static)
        for step in range(first, tl.minimum(first + chunks_each * CHUNK_STEPS, steps)):
            if TMA:
                x = x_desc.load([pid_m * BLOCK_M, step * BLOCK_K])
                w = w_desc.load([pid_n * BLOCK_N, step * BLOCK_K]).T
            else:
                k = step * BLOCK_K + offs_k
                k_mask = k < K
                x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(w_cols + k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            if MODE == 2:
                if QUANT_X:  # this step's group, each row by its own amax
                    x_scale = dynamic_scale(tl.max(tl.abs(x.to(tl.float32)), axis=1))
                    x = quantize_e4m3(x, x_scale[:, None], tl.math.div_rn(1.0, x_scale)[:, None])
                else:
                    x_scale = tl.load(x_scale_ptr + offs_m * stride_xs + step, mask=m_mask, other=0.0)
                w_scale = tl.load(w_scale_ptr + (offs_n // 128) * stride_ws + step, mask=n_mask, other=0.0)
                acc += tl.dot(x, w) * (x_scale[:, None] * w_scale[None, :])
            else:
                if QUANT_X:
                    x = quantize_e4m3(x, static, static_rcp)
                acc = tl.dot(x, w, acc)
            if (step + 1) % CHUNK_STEPS == 0 or step + 1 == steps:
                if SPLIT:
                    # A split runs where few tiles fill the GPU: every (chunk, row, column) index fits in 32 bits.
                    part = part_ptr + (step // CHUNK_STEPS * M + offs_m[:, None]) * N + offs_n[None, :]
                    tl.store(part, acc, mask=m_mask[:, None] & n_mask[None, :])
                else:
                    total += acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SPLIT:
            # Every thread's chunk sums are written before the release by the counter atomic; the tile's
            # last program to arrive adds all its chunks in chunk order, as one program would have.
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(1) - 1:
                mask = m_mask[:, None] & n_mask[None, :]
                parts = part_ptr + offs_m[:, None] * N + offs_n[None, :]
                for c in range(0, tl.cdiv(steps, CHUNK_STEPS)):
                    total += tl.load(parts + c * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                _finish(total, out_ptr, bias_ptr, x_scale_ptr, w_scale_ptr, offs_m, offs_n, M, N, stride_om,
                        stride_xs, stride_ws, MODE, HAS_BIAS)  # fmt: skip
                tl.atomic_xchg(cnt_ptr + pid, 0)  # zero again for the next launch or graph replay
        else:
            _finish(total, out_ptr, bias_ptr, x_scale_ptr, w_scale_ptr, offs_m, offs_n, M, N, stride_om,
                    stride_xs, stride_ws, MODE, HAS_BIAS)  # fmt: skip

    _GEMM = DirectLauncher(fixed_gemm_kernel, pointers=8, pdl=True)


def programs_per_tile(m: int, n: int, k: int, sms: int, tiles: FixedTiles = TILES, element_size: int = 1) -> int:
    """How many programs share each output tile's chunks. Where the tiles leave SMs idle, a split
    spreads a tile's chunks over up to tiles.programs_per_sm programs per SM (rounded down), while the
    chunk sums' round trip through memory stays within a quarter of the weight's bytes: past that it
    costs more than the idle SMs (benchmarks/results/h100/deterministic). It may follow M: the sums do not."""
    count = cdiv(m, tiles.block_m) * cdiv(n, tiles.block_n)
    chunks = cdiv(k, tiles.block_k * tiles.chunk_steps)
    if 32 * chunks * m > k * element_size:  # 8 bytes a sum per chunk, row and column vs the weight's
        return 1
    return max(1, min(chunks, tiles.programs_per_sm * sms // count))


def stages_that_fit(tiles: FixedTiles, element_size: int, split: bool) -> int:
    """tiles.num_stages, fewer where 16-bit operands' tiles would not fit shared memory beside, in a
    split, the fp32 tile a chunk's sum is stored through (the stages pipeline the loads; they do not
    touch the order of the sum). 128x128 bf16 tiles in a split: 2 stages (an H100 refused 3)."""
    per_stage = (tiles.block_m + tiles.block_n) * tiles.block_k * element_size
    room = _SMEM - (4 * tiles.block_m * tiles.block_n if split else 0)
    return max(1, min(tiles.num_stages, room // per_stage))


def fixed_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tiles: FixedTiles | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] in out_dtype, each row's bits independent of M.

    x and weight are both e4m3 with their scales (x_scale: a scalar or [M] with weight_scale a
    scalar or [N]; or [M, ceil(K/128)] with [ceil(N/128), ceil(K/128)] for 128x128 weight blocks),
    or both 16-bit with no scales; tiles: TILES by default. No host sync: graph-safe."""
    tiles = tiles or TILES
    _check(x, weight, x_scale, weight_scale, bias, tiles)
    return launch(x, weight, x_scale, weight_scale, bias, out_dtype, tiles)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tiles: FixedTiles | None = None,
) -> torch.Tensor:
    """fixed_gemm without its checks, for a backend whose plan vetted the layer (a forward's path)."""
    tiles = tiles or TILES
    mode = NONE if weight_scale is None else BLOCKS if weight_scale.dim() == 2 else ROWS
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    xs = x_scale if x_scale is not None else out  # an unread pointer where there is no scale
    ws = weight_scale if weight_scale is not None else out
    stride_xs = 0 if x_scale is None or xs.numel() == 1 else xs.stride(0)
    stride_ws = 0 if mode == NONE or ws.numel() == 1 else ws.stride(0)
    bias_arg = bias if bias is not None else out
    split = programs_per_tile(m, n, k, launch_sms(x.device), tiles, weight.element_size())
    chunks = cdiv(k, tiles.block_k * tiles.chunk_steps)
    chunks_each = cdiv(chunks, split)
    split = cdiv(chunks, chunks_each)
    part = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    tiles_count = cdiv(m, tiles.block_m) * cdiv(n, tiles.block_n)
    cnt = counters(x.device, tiles_count, "fixed_gemm") if split > 1 else out
    meta: dict[str, Any] = dict(
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, CHUNK_STEPS=tiles.chunk_steps,
        GROUP_M=tiles.group_m, MODE=mode, HAS_BIAS=bias is not None, SPLIT=split > 1, QUANT_X=tiles.quantize_x,
        TMA=tiles.tma and _tma_ready(x, weight),
        num_warps=tiles.num_warps, num_stages=stages_that_fit(tiles, x.element_size(), split > 1),
    )  # fmt: skip
    args = (
        x, weight, out, part, cnt, bias_arg, xs, ws,
        m, n, k, x.stride(0), weight.stride(0), n, stride_xs, stride_ws, chunks_each,
    )  # fmt: skip
    key = (x.dtype, weight.dtype, out_dtype, *int_key(n, k, x.stride(0), weight.stride(0), stride_xs, stride_ws))
    _GEMM((tiles_count, split), key, args, meta)
    return out


def _tma_ready(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this GPU has TMA and both operands suit a descriptor (16-byte aligned base and rows);
    where not, the tiles load by pointers, which gives the same bits (a plan keeps TMA tilings off GPUs
    without it, FixedTilesBackend.why_not; a sliced operand can still be unaligned). The descriptors are
    made in the kernel, in scratch memory Triton asks its allocator for at each launch (set here where the
    context has none: Triton keeps the allocator per context, so a thread of its own starts without it)."""
    if not has_tma(x.device):
        why = f"{x.device} has no TMA"
    elif not all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, weight)):
        why = "an operand's base or rows are not 16-byte aligned"
    else:
        if _no_allocator():
            triton.set_allocator(_scratch)
        return True
    if why not in _pointer_loads_logged:
        _pointer_loads_logged.add(why)
        log.warning("fixed-tile GEMM: tiles meant for TMA load by pointers (the same bits, slower): %s", why)
    return False


def _no_allocator() -> bool:
    """Whether this context lacks a Triton allocator: one a user set is kept. Triton exposes no getter;
    where its private module moves (or Triton is absent), ours is set at each launch."""
    return _TRITON_ALLOCATOR is None or isinstance(_TRITON_ALLOCATOR.get(), _NullAllocator)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    tiles: FixedTiles,
) -> None:
    """Refuse operands that do not fit each other, with the reason."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise Fp8InputError(
            f"fixed_gemm: x [M, K] and weight [N, K] expected, got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if tiles.quantize_x:
        _check_quantized_inside(x, weight, x_scale, weight_scale, tiles)
    elif x.dtype != weight.dtype:
        raise Fp8InputError(f"fixed_gemm: x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise Fp8InputError("fixed_gemm: x and weight need a contiguous last (K) dimension")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise Fp8InputError(f"fixed_gemm: bias must be a contiguous [{weight.shape[0]}] tensor")
    if tiles.quantize_x:
        return
    if x.element_size() == 2:
        if x_scale is not None or weight_scale is not None:
            raise Fp8InputError("fixed_gemm: 16-bit operands take no scales")
        return
    if x_scale is None or weight_scale is None:
        raise Fp8InputError("fixed_gemm: e4m3 operands need x_scale and weight_scale")
    if x_scale.dtype != torch.float32 or weight_scale.dtype != torch.float32:
        raise Fp8InputError(f"fixed_gemm: scales must be fp32, got {x_scale.dtype} and {weight_scale.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    if weight_scale.dim() == 2:
        if tiles.block_k != BLOCK:
            raise Fp8InputError(f"fixed_gemm: 128x128 weight blocks need block_k={BLOCK}, got {tiles.block_k}")
        groups = cdiv(k, BLOCK)
        expected = {"x_scale": (x_scale, (m, groups)), "weight_scale": (weight_scale, (cdiv(n, BLOCK), groups))}
        for name, (s, shape) in expected.items():
            if tuple(s.shape) != shape or s.stride(1) != 1:
                raise Fp8InputError(f"fixed_gemm: {name} must be {shape} with contiguous rows, got {tuple(s.shape)}")
        return
    for name, s, rows in (("x_scale", x_scale, m), ("weight_scale", weight_scale, n)):
        if s.numel() != 1 and tuple(s.shape) != (rows,):
            raise Fp8InputError(f"fixed_gemm: {name} must be a scalar or [{rows}], got {tuple(s.shape)}")


def _check_quantized_inside(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    tiles: FixedTiles,
) -> None:
    """Tiles that quantize x inside: 16-bit x, an e4m3 weight with its fp32 scale, and x's scale static
    (one fp32 scalar) beside a weight scale per tensor or channel, or none beside 128x128 weight blocks."""
    if x.element_size() != 2 or weight.dtype != torch.float8_e4m3fn or weight_scale is None:
        raise Fp8InputError(
            f"fixed_gemm: tiles with quantize_x take 16-bit x and an e4m3 weight with its scale, got {x.dtype} "
            f"and {weight.dtype}"
        )
    if weight_scale.dtype != torch.float32:
        raise Fp8InputError(f"fixed_gemm: weight_scale must be fp32, got {weight_scale.dtype}")
    if weight_scale.dim() == 2:
        n, k = weight.shape
        shape = (cdiv(n, BLOCK), cdiv(k, BLOCK))
        if x_scale is not None:
            raise Fp8InputError("fixed_gemm: beside 128x128 weight blocks x's group scales are computed inside")
        if tiles.block_k != BLOCK:
            raise Fp8InputError(f"fixed_gemm: 128x128 weight blocks need block_k={BLOCK}, got {tiles.block_k}")
        if tuple(weight_scale.shape) != shape or weight_scale.stride(1) != 1:
            raise Fp8InputError(f"fixed_gemm: weight_scale must be {shape} with contiguous rows")
    elif x_scale is None or x_scale.numel() != 1 or x_scale.dtype != torch.float32:
        raise Fp8InputError("fixed_gemm: tiles with quantize_x need x's static scale, one fp32 scalar")
    elif weight_scale.numel() != 1 and tuple(weight_scale.shape) != (weight.shape[0],):
        raise Fp8InputError(f"fixed_gemm: weight_scale must be a scalar or [{weight.shape[0]}]")
