"""Small-M (decode) static per-tensor FP8 linear: activation quantization fused into a split-K GEMV/GEMM.

    out = (q(x) @ w.T) * input_scale * weight_scale + bias,   q(x) = e4m3(clamp(x / input_scale, +-448))

Why kernels of our own: the separate quantization kernel costs every linear one more launch, and
at decode sizes the library FP8 GEMMs sit well above the memory floor. What they reach on the H200
(benchmarks/DECODE.md): Llama-3.1-8B TP1 sum at M=1 77.0 µs per call vs 86.6 for cuBLASLt +
quantization (66.8 vs 74.1 in a CUDA graph; a kernel that only reads those weights needs 65.9 and
58.7), 1.15-1.6x on the TP4 shapes; at M=16 a tie, from M=32 on mostly a loss. The router decides
by measurement.

Two kernels behind one op, picked per (N, K, M bucket):
- CUDA-core (M <= 8, used at M=1): 16-32-row blocks, each lane streams 16 contiguous weight bytes
  per row and K-step with one 128-bit load, converts them to fp32 (exact) and multiplies by its
  quantized x; rows are reduced across the warp. No token padding, no shared-memory staging.
- wgmma (M 2..128): swap AB, the weight rows on the MMA's M side (64 to 256 per tile) and the tokens
  on its N side (16..64), so the weight goes straight from shared memory into the tensor cores.
Both:
- Split-K to put several CTAs' worth of loads in flight on every SM; each split writes its fp32
  partial to a workspace and the last CTA of a tile (an integer counter tells which) sums the
  partials in split order. The counter is reset by that CTA, so the kernel is graph-safe, and the
  sum order never depends on timing, so the bits repeat run to run (no float atomics).
- x is read as bf16/fp16 and quantized in registers bit-identically to the standalone quantizer
  (correctly rounded x / s, saturate, round-to-nearest-even); a pre-quantized e4m3 x is accepted too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fp8route.errors import Fp8InputError, Fp8TypeError

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: str | None = None
except ImportError as exc:  # CPU-only installs: the module still imports, why_not() says why
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    TRITON_IMPORT_ERROR = f"triton is not importable: {exc}"

FP8 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16)
M_MAX = 128  # decode sizes; it already loses to cuBLASLt from M=32 on the H200
CUDA_CORE_M_MAX = 8  # the CUDA-core kernel's FMAs grow with M; from 16 on the tensor cores win
K_ALIGN = 16  # 16-byte rows of the fp8 weight: cp.async / wgmma operand alignment
_REDUCE_UNROLL = 8  # partials summed per round by the last CTA (loads in flight)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows per tile (wgmma M side: 64, 128 or 256)
    block_k: int
    block_m: int  # tokens per tile (wgmma N side)
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    cuda_core: bool = False  # the CUDA-core kernel (block_m <= CUDA_CORE_M_MAX) instead of wgmma
    maxnreg: int = 0  # registers per thread at most (0: the compiler's choice); fewer fit more CTAs per SM


def why_not(m_max: int, n: int, k: int) -> str | None:
    """None if fp8_gemv supports every M in 1..m_max for an [N, K] weight, else the reason."""
    if TRITON_IMPORT_ERROR is not None:
        return TRITON_IMPORT_ERROR
    if m_max < 1 or m_max > M_MAX:
        return f"M={m_max} is outside 1..{M_MAX}: the kernel is built for decode-sized batches"
    if k % K_ALIGN:
        return f"K={k} is not a multiple of {K_ALIGN} (16-byte fp8 weight rows)"
    if n < 1 or k < K_ALIGN:
        return f"N={n}, K={k}: empty or too small"
    if n * k >= 2**31 or m_max * max(n, k) >= 2**31:
        return f"N*K={n * k} needs 64-bit offsets, which this kernel does not use"
    return None


_SMEM_PER_SM = 227 * 1024  # Hopper: shared memory one SM can give its CTAs
# (block_n, block_k, num_warps, num_stages) per block_m when no measured entry exists.
_DEFAULT_BLOCKS = {16: (256, 128, 8, 4), 32: (128, 128, 8, 4), 64: (128, 128, 8, 4)}
# Fastest config per M bucket from `benchmarks/decode_bench.py --sweep` on the H200 (cold L2; token tiles
# below M from `--sweep-block-ms`, 8-warp CUDA-core blocks from `results/h200/decode_limits/`):
# (N, K) -> ((m_max, GemvConfig(block_n, block_k, block_m, split_k, num_warps, num_stages)), ...).
_H200_TABLE: dict[tuple[int, int], tuple[tuple[int, GemvConfig], ...]] = {
    (6144, 4096): (  # 8B qkv (registers capped at 80: 3 CTAs per SM instead of 2, 11.0 vs 12.2 µs)
        (1, GemvConfig(16, 2048, 1, 1, 8, 1, cuda_core=True, maxnreg=80)),
        (16, GemvConfig(256, 128, 16, 4, 8, 4)),
        (32, GemvConfig(256, 128, 32, 4, 8, 3)),
        (128, GemvConfig(128, 64, 64, 4, 8, 6)),
    ),
    (4096, 4096): (  # 8B o
        (1, GemvConfig(16, 2048, 1, 1, 8, 1, cuda_core=True)),
        (2, GemvConfig(256, 128, 16, 8, 8, 4)),
        (16, GemvConfig(128, 256, 16, 4, 8, 3)),
        (32, GemvConfig(256, 128, 32, 8, 8, 3)),
        (128, GemvConfig(128, 128, 64, 4, 8, 4)),
    ),
    (28672, 4096): (  # 8B gate_up
        (1, GemvConfig(32, 512, 1, 1, 8, 1, cuda_core=True)),
        (16, GemvConfig(256, 128, 16, 1, 8, 4)),
        (32, GemvConfig(128, 128, 32, 1, 8, 4)),
        (128, GemvConfig(256, 64, 64, 1, 8, 4)),
    ),
    (4096, 14336): (  # 8B down
        (1, GemvConfig(32, 512, 1, 4, 8, 1, cuda_core=True)),
        (8, GemvConfig(256, 128, 16, 8, 8, 4)),
        (16, GemvConfig(128, 256, 16, 4, 8, 3)),
        (32, GemvConfig(128, 128, 32, 8, 8, 4)),
        (128, GemvConfig(128, 128, 64, 4, 8, 4)),
    ),
    (1536, 4096): (  # 8B TP4 qkv
        (1, GemvConfig(16, 2048, 1, 1, 8, 1, cuda_core=True)),
        (2, GemvConfig(8, 512, 2, 8, 1, 3, cuda_core=True)),
        (4, GemvConfig(128, 256, 16, 8, 8, 3)),
        (8, GemvConfig(128, 128, 16, 11, 8, 5)),
        (16, GemvConfig(128, 256, 16, 8, 8, 3)),
        (32, GemvConfig(128, 256, 16, 4, 8, 3)),
        (64, GemvConfig(128, 128, 16, 5, 8, 5)),
        (128, GemvConfig(128, 128, 64, 8, 8, 4)),
    ),
    (4096, 1024): (  # 8B TP4 o
        (1, GemvConfig(16, 1024, 1, 1, 8, 1, cuda_core=True)),
        (2, GemvConfig(16, 1024, 2, 1, 8, 1, cuda_core=True)),
        (4, GemvConfig(64, 128, 16, 1, 4, 6)),
        (8, GemvConfig(128, 256, 16, 1, 8, 3)),
        (16, GemvConfig(64, 128, 16, 1, 4, 6)),
        (64, GemvConfig(128, 256, 16, 1, 8, 3)),
        (128, GemvConfig(128, 128, 64, 4, 8, 4)),
    ),
    (7168, 4096): (  # 8B TP4 gate_up
        (1, GemvConfig(16, 1024, 1, 1, 8, 1, cuda_core=True)),
        (16, GemvConfig(256, 128, 16, 4, 8, 4)),
        (32, GemvConfig(256, 128, 32, 4, 8, 3)),
        (64, GemvConfig(256, 128, 32, 2, 8, 3)),
        (128, GemvConfig(128, 128, 64, 2, 8, 4)),
    ),
    (4096, 3584): (  # 8B TP4 down
        (1, GemvConfig(16, 512, 1, 1, 4, 3, cuda_core=True)),
        (2, GemvConfig(16, 512, 2, 1, 2, 3, cuda_core=True)),
        (8, GemvConfig(256, 128, 16, 7, 8, 4)),
        (16, GemvConfig(128, 256, 16, 4, 8, 3)),
        (32, GemvConfig(128, 128, 16, 4, 8, 5)),
        (64, GemvConfig(256, 128, 32, 4, 8, 3)),
        (128, GemvConfig(128, 128, 64, 4, 8, 4)),
    ),
}  # fmt: skip


def block_m_for(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def ctas_per_sm(block_n: int, block_k: int, block_m: int, num_stages: int) -> int:
    """CTAs of one config that fit an SM's shared memory (each stage: a weight tile and a bf16 x tile)."""
    return max(1, _SMEM_PER_SM // (num_stages * (block_n * block_k + 2 * block_k * block_m)))


@functools.lru_cache(maxsize=4096)
def choose_config(m: int, n: int, k: int, num_sms: int = 132) -> GemvConfig:
    """The launch configuration for one (M, N, K): the measured entry if there is one, else one wave.

    One wave: split K so that tiles x splits just fills every SM's CTA slots once. Every CTA then
    streams an equal share from start to end; a second, partial wave left SMs idle at the tail,
    and more, shorter CTAs paid their pipeline fill and split-K epilogue more often.
    """
    if num_sms == 132:
        for m_max, cfg in _H200_TABLE.get((n, k), ()):
            if m <= m_max:
                return cfg
    if m == 1:
        return _one_token_config(n, k, num_sms)
    block_m = block_m_for(m)
    block_n, block_k, warps, stages = _DEFAULT_BLOCKS[block_m]
    block_k = min(block_k, max(K_ALIGN, triton.next_power_of_2(k)))
    slots = num_sms * ctas_per_sm(block_n, block_k, block_m, stages)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = max(1, min(slots // tiles, triton.cdiv(k, block_k)))
    return GemvConfig(block_n, block_k, block_m, split, num_warps=warps, num_stages=stages)


def _one_token_config(n: int, k: int, num_sms: int) -> GemvConfig:
    """The CUDA-core kernel, which won at M=1 on every swept H200 shape but one (a tie): 16-row
    blocks, one warp-wide 512-byte K-step per row, split-K up to about eight CTAs per SM while every
    split keeps at least two K-steps."""
    block_k = min(512, max(K_ALIGN, triton.next_power_of_2(k)))
    tiles, k_iters = triton.cdiv(n, 16), triton.cdiv(k, block_k)
    split = 1
    while tiles * split * 2 <= 8 * num_sms and k_iters // (split * 2) >= 2:
        split *= 2
    return GemvConfig(16, block_k, 1, split, num_warps=4, num_stages=1, cuda_core=True)


if triton is not None:

    @triton.jit
    def _quantize(x, s, r):
        """e4m3(clamp(x / s, +-448)) with x / s correctly rounded, as torch's division gives it.

        Per-element IEEE division (div_rn) made the fused kernel 3-5x slower than the GEMM alone
        (its slow path runs for every zero, i.e. every padded token row). Instead: q0 = x * r with
        r = RN(1/s), then two FMA residual corrections; by Markstein's theorem the last one returns
        RN(x / s) once its input is within 1 ulp. Quotients past 2^16 saturate to 448 anyway, and
        skipping the correction there keeps inf from turning into NaN; skipping it at zero keeps
        the sign of -0 (the correction would return +0).
        """
        x = x.to(tl.float32)
        q = x * r
        q1 = tl.fma(tl.fma(-q, s, x), r, q)
        q2 = tl.fma(tl.fma(-q1, s, x), r, q1)
        q = tl.where((tl.abs(q) < 65536.0) & (q != 0.0), q2, q)
        # No clamp to +-448: the e4m3 conversion is cvt.rn.satfinite, which saturates (inf too) and
        # keeps NaN, as the clamp would.
        return q.to(tl.float8e4nv)

    @triton.jit
    def _store_out(acc, out_ptr, bias_ptr, scale, offs_n, offs_m, n_mask, m_mask, stride_om, HAS_BIAS: tl.constexpr):
        y = acc * scale
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])

    @triton.jit
    def _finish(
        acc, out_ptr, bias_ptr, ws_ptr, cnt_ptr, scale, pid_k, tile, split_k,
        M, N, stride_om, offs_n, offs_m, n_mask, m_mask,
        HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr, REDUCE_UNROLL: tl.constexpr,
    ):  # fmt: skip
        """Write a [BLOCK_N, BLOCK_M] fp32 tile: directly, or as split pid_k's partial, summed by the last split."""
        if USE_WS:
            mn_mask = n_mask[:, None] & m_mask[None, :]
            mn_offs = offs_m[None, :] * N + offs_n[:, None]
            tl.store(ws_ptr + pid_k * (M * N) + mn_offs, acc, mask=mn_mask)
            # Every thread's partial must be written before the release by the counter atomic.
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:
                total = tl.zeros(acc.shape, dtype=tl.float32)
                # Fixed order s = 0, 1, 2 ... so the bits never depend on which CTA came last.
                for s0 in range(0, split_k, REDUCE_UNROLL):
                    for j in tl.static_range(REDUCE_UNROLL):
                        part = tl.load(
                            ws_ptr + (s0 + j) * (M * N) + mn_offs,
                            mask=mn_mask & (s0 + j < split_k),
                            other=0.0,
                            cache_modifier=".cg",
                        )
                        total += part
                _store_out(total, out_ptr, bias_ptr, scale, offs_n, offs_m, n_mask, m_mask, stride_om, HAS_BIAS)
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call / graph replay
        else:
            _store_out(acc, out_ptr, bias_ptr, scale, offs_n, offs_m, n_mask, m_mask, stride_om, HAS_BIAS)

    # M and split_k vary per call; specializing on them (==1, %16) would only multiply compiles.
    @triton.jit(do_not_specialize=["M", "split_k"])
    def _fp8_gemv_kernel(
        x_ptr, w_ptr, out_ptr, bias_ptr, ws_ptr, cnt_ptr, w_scale_ptr, in_scale_ptr,
        M, N, K, stride_xm, stride_wn, stride_om, split_k, k_per_split,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
        QUANT_X: tl.constexpr, HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
        REDUCE_UNROLL: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        # The splits of one tile are adjacent pids: launched together, so the last one (which
        # reduces) does not wait on a split scheduled a wave later.
        pid_k = pid % split_k
        tile = pid // split_k
        # Token tiles of one weight tile are adjacent too: they run together and share its bytes
        # through L2, so BLOCK_M below M reads the weight from memory about once.
        num_m_tiles = tl.cdiv(M, BLOCK_M)
        pid_m = tile % num_m_tiles
        pid_n = tile // num_m_tiles

        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        m_mask = offs_m < M
        k_lo = pid_k * k_per_split

        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]
        # x^T tile [BLOCK_K, BLOCK_M]: K-contiguous, which is what fp8 wgmma wants for its B operand.
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k_lo + offs_k)[:, None]
        in_scale = tl.load(in_scale_ptr)
        in_scale_rcp = tl.math.div_rn(1.0, in_scale)

        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        # EVEN_K: every split covers exactly k_per_split (a multiple of BLOCK_K) inside K.
        for k in range(0, k_per_split, BLOCK_K):
            if EVEN_K:
                if EVEN_N:  # noqa: SIM108 (one load per constexpr branch)
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
                xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            else:
                k_mask = (k_lo + k + offs_k) < K
                w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                xt = tl.load(x_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
            if QUANT_X:  # noqa: SIM108 (constexpr branches, as the loads above)
                xq = _quantize(xt, in_scale, in_scale_rcp)
            else:
                xq = xt
            # Promote the tensor cores' reduced-precision fp8 accumulation to fp32 every
            # IMPRECISE_ACC elements of K (cuBLASLt's default, non fast-accum, does likewise).
            acc = tl.dot(w, xq, acc, max_num_imprecise_acc=IMPRECISE_ACC)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K

        _finish(acc, out_ptr, bias_ptr, ws_ptr, cnt_ptr, in_scale * tl.load(w_scale_ptr), pid_k, tile, split_k,
                M, N, stride_om, offs_n, offs_m, n_mask, m_mask, HAS_BIAS, USE_WS, REDUCE_UNROLL)  # fmt: skip

    @triton.jit(do_not_specialize=["M", "split_k"])
    def _fp8_gemv_cuda_core_kernel(
        x_ptr, w_ptr, out_ptr, bias_ptr, ws_ptr, cnt_ptr, w_scale_ptr, in_scale_ptr,
        M, N, K, stride_xm, stride_wn, stride_om, split_k, k_per_split,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
        QUANT_X: tl.constexpr, HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, REDUCE_UNROLL: tl.constexpr, NUM_STAGES: tl.constexpr,
    ):  # fmt: skip
        """The same product for a few tokens (BLOCK_M <= 8) on the CUDA cores: no shared-memory staging
        of the weight and no MMA padding of the token side to 16. Each weight element is converted once
        (e4m3 -> fp32, exact) and multiplied by every token's x in fp32; the products are exact, so only
        the fp32 sums round."""
        pid = tl.program_id(0)
        pid_k = pid % split_k
        pid_n = pid // split_k
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        m_mask = offs_m < M
        k_lo = pid_k * k_per_split

        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]
        x_ptrs = x_ptr + k_lo + offs_k
        in_scale = tl.load(in_scale_ptr)
        in_scale_rcp = tl.math.div_rn(1.0, in_scale)

        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in tl.range(0, k_per_split, BLOCK_K, num_stages=NUM_STAGES):
            if EVEN_K:
                k_mask = offs_k < BLOCK_K
                if EVEN_N:  # noqa: SIM108 (one load per constexpr branch)
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            else:
                k_mask = (k_lo + k + offs_k) < K
                w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            w = w.to(tl.float32)
            # Token by token: a [BLOCK_N, BLOCK_M, BLOCK_K] product would spread K over the threads
            # one element each and move every operand through shared memory.
            for i in tl.static_range(BLOCK_M):
                xt = tl.load(x_ptrs + i * stride_xm, mask=k_mask & (i < M), other=0.0)
                if QUANT_X:
                    xt = _quantize(xt, in_scale, in_scale_rcp)
                part = tl.sum(w * xt.to(tl.float32)[None, :], axis=1)
                acc += tl.where(offs_m[None, :] == i, part[:, None], 0.0)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K

        _finish(acc, out_ptr, bias_ptr, ws_ptr, cnt_ptr, in_scale * tl.load(w_scale_ptr), pid_k, pid_n, split_k,
                M, N, stride_om, offs_n, offs_m, n_mask, m_mask, HAS_BIAS, USE_WS, REDUCE_UNROLL)  # fmt: skip


# One zeroed counter buffer per device, kept zero by the kernel itself. Two fp8_gemv calls running
# concurrently on different streams of one device would share it: serialize them (decode does).
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_COUNTERS_MIN = 1 << 14


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fp8_gemv: run each shape once outside CUDA-graph capture first "
                "(its split-K counter buffer is allocated on first use)"
            )
        buf = torch.zeros(max(tiles, _COUNTERS_MIN), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
           bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:  # fmt: skip
    if x.dim() != 2 or weight.dim() != 2:
        raise Fp8InputError(
            f"fp8_gemv: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[1] != weight.shape[1]:
        raise Fp8InputError(f"fp8_gemv: x has K={x.shape[1]} but weight has K={weight.shape[1]}")
    if weight.dtype != FP8:
        raise Fp8TypeError(f"fp8_gemv: weight must be float8_e4m3fn, got {weight.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, FP8):
        raise Fp8TypeError(f"fp8_gemv: x must be bfloat16, float16 or float8_e4m3fn, got {x.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise Fp8TypeError(f"fp8_gemv: out_dtype must be bfloat16 or float16, got {out_dtype}")
    for name, s in (("weight_scale", weight_scale), ("input_scale", input_scale)):
        if s.numel() != 1 or s.dtype != torch.float32 or s.device != weight.device:
            got = f"{s.dtype} {tuple(s.shape)} on {s.device}"
            raise Fp8InputError(f"fp8_gemv: {name} must be one fp32 value on {weight.device}, got {got}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != out_dtype or not bias.is_contiguous()):
        got = f"{bias.dtype} {tuple(bias.shape)}"
        raise Fp8InputError(f"fp8_gemv: bias must be a contiguous [{weight.shape[0]}] {out_dtype} tensor, got {got}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise Fp8InputError("fp8_gemv: x and weight need a contiguous last (K) dimension")
    reason = why_not(x.shape[0], weight.shape[0], weight.shape[1])
    if reason is not None:
        raise Fp8InputError(f"fp8_gemv: {reason}")


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """(q(x) @ weight.T) * input_scale * weight_scale + bias for x [M, K] (bf16/fp16, or e4m3 already
    quantized with input_scale) and an e4m3 weight [N, K]; fp32 accumulation, out [M, N] in out_dtype.

    No host sync and no data-dependent allocation: safe inside CUDA-graph capture once the shape
    has run eagerly (first call allocates the split-K counters). Deterministic.
    """
    _check(x, weight, weight_scale, input_scale, bias, out_dtype)
    return launch(x, weight, weight_scale, input_scale, bias, out_dtype, out=out, config=config)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """fp8_gemv without the argument checks, for callers whose plan already vetted the layer and
    whose forward checked x: the checks cost microseconds of host time on every decode step."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or choose_config(m, n, k, _num_sms(weight.device.index or 0))
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or out.stride(1) != 1:
        raise Fp8InputError(f"fp8_gemv: out must be [{m}, {n}] {out_dtype} with contiguous rows")

    if cfg.cuda_core and m > cfg.block_m:
        raise Fp8InputError(f"fp8_gemv: {cfg} takes at most {cfg.block_m} tokens, got M={m}")
    k_iters = triton.cdiv(k, cfg.block_k)
    split = max(1, min(cfg.split_k, k_iters))
    k_per_split = triton.cdiv(k_iters, split) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # no empty splits
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    use_ws = split > 1
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if use_ws else out
    cnt = _counters(x.device, tiles) if use_ws else out

    args = (
        x, weight, out, bias if bias is not None else out, ws, cnt, weight_scale, input_scale,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), split, k_per_split,
    )  # fmt: skip
    flags = dict(
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=cfg.block_m,
        QUANT_X=x.dtype != FP8, HAS_BIAS=bias is not None, USE_WS=use_ws,
        EVEN_K=k_per_split * split == k, EVEN_N=n % cfg.block_n == 0, REDUCE_UNROLL=_REDUCE_UNROLL,
        num_warps=cfg.num_warps, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )  # fmt: skip
    if cfg.cuda_core:
        _fp8_gemv_cuda_core_kernel[(tiles * split,)](*args, **flags, NUM_STAGES=cfg.num_stages)
    else:
        _fp8_gemv_kernel[(tiles * split,)](
            *args, **flags, IMPRECISE_ACC=min(128, cfg.block_k), num_stages=cfg.num_stages
        )
    return out


if triton is not None:

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, scale_ptr, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        s = tl.load(scale_ptr)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.store(q_ptr + offs, _quantize(x, s, tl.math.div_rn(1.0, s)), mask=mask)


def quantize_fp8(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """The standalone static quantizer as one kernel launch (the baseline that fp8_gemv fuses away).

    Bit-identical to (x.float() / input_scale).clamp(-448, 448).to(torch.float8_e4m3fn).
    """
    if not x.is_contiguous():
        raise Fp8InputError("quantize_fp8: x must be contiguous")
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    block = 1024
    _quantize_kernel[(triton.cdiv(x.numel(), block),)](x, q, input_scale, x.numel(), BLOCK=block, num_warps=4)
    return q
