"""Activation quantization to e4m3 in Triton: static per-tensor (one pass), dynamic per token and per
1x128 group (each row's or group's amax/448 as its scale), and the device functions every fused
kernel shares so that fused and standalone quantization give the same bits."""

from __future__ import annotations

import torch

from fp8route.errors import Fp8InputError
from fp8route.kernels.launcher import DirectLauncher, int_key
from fp8route.kernels.triton_support import tl, triton
from fp8route.quant import FP8_DTYPE
from fp8route.schemes import BLOCK, cdiv

if triton is not None:
    from fp8route.kernels.pdl import wait_for_inputs

    @triton.jit
    def quantize_e4m3(x, s, r):
        """e4m3(clamp(x / s, +-448)) with x / s correctly rounded, as torch's division gives it.

        Per-element IEEE division (div_rn) made the fused decode kernel 3-5x slower than the GEMM
        alone (its slow path runs for every zero, i.e. every padded token row). Instead: q0 = x * r
        with r = RN(1/s), then two FMA residual corrections; by Markstein's theorem the last one
        returns RN(x / s) once its input is within 1 ulp. Quotients past 2^16 saturate to 448
        anyway, and skipping the correction there keeps inf from turning into NaN; skipping it at
        zero keeps the sign of -0 (the correction would return +0).
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
    def _quantize_kernel(x_ptr, q_ptr, scale_ptr, numel, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        wait_for_inputs(USE_PDL)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # a prefill passes 2^31 elements
        mask = offs < numel
        s = tl.load(scale_ptr)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.store(q_ptr + offs, quantize_e4m3(x, s, tl.math.div_rn(1.0, s)), mask=mask)

    @triton.jit
    def dynamic_scale(amax):
        """amax / 448 correctly rounded (as torch divides), at least 1e-12 (fp8route.schemes.MIN_SCALE):
        a zero row's scale."""
        return tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        """One program a row: its amax over K, then the row quantized with amax / 448 (per token)."""
        wait_for_inputs(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_xm + k + offs, mask=k + offs < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        s = dynamic_scale(tl.max(amax, axis=0))
        r = tl.math.div_rn(1.0, s)
        for k in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_xm + k + offs, mask=k + offs < K, other=0.0)
            tl.store(q_ptr + row * K + k + offs, quantize_e4m3(x, s, r), mask=k + offs < K)
        tl.store(scale_ptr + row, s)

    @triton.jit
    def _quantize_groups_kernel(
        x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_sm, stride_sg,
        GROUPS: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """One program per row and GROUPS groups of 128: each group quantized with its amax / 448."""
        wait_for_inputs(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        cols = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
        mask = cols < K
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0)
        s = dynamic_scale(tl.max(tl.abs(x.to(tl.float32)), axis=1))
        q = quantize_e4m3(x, s[:, None], tl.math.div_rn(1.0, s)[:, None])
        tl.store(q_ptr + row * K + cols, q, mask=mask)
        tl.store(scale_ptr + row * stride_sm + groups * stride_sg, s, mask=groups * 128 < K)

    _BLOCK = 1024
    _META = {"BLOCK": _BLOCK, "num_warps": 4}
    _LAUNCHER = DirectLauncher(_quantize_kernel, pointers=3, pdl=True)
    _ROWS_META = {"BLOCK": 2048, "num_warps": 8}
    _ROWS = DirectLauncher(_quantize_rows_kernel, pointers=3, pdl=True)
    _GROUPS = 8  # groups a program: 1024 elements, as the per-tensor kernel's block
    _GROUPS_META = {"GROUPS": _GROUPS, "num_warps": 4}
    _GROUPS_LAUNCHER = DirectLauncher(_quantize_groups_kernel, pointers=3, pdl=True)


def quantize_fp8(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x quantized with a static scale in one kernel launch (eager torch takes four kernels over
    fp32 temporaries). Bit-identical to (x.float() / input_scale).clamp(-448, 448).to(float8_e4m3fn)."""
    if not x.is_contiguous():
        raise Fp8InputError("quantize_fp8: x must be contiguous")
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    numel = x.numel()
    # What triton specializes numel on: == 1, % 16, 32 or 64 bits.
    key = (x.dtype, numel == 1, numel % 16 == 0, numel < 2**31)
    _LAUNCHER(((numel + _BLOCK - 1) // _BLOCK,), key, (x, q, input_scale, numel), _META)
    return q


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise Fp8InputError(f"{name}: x must be 2-D [M, K] with a contiguous last dimension, got {tuple(x.shape)}")


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized per row: (e4m3 [M, K], fp32 scales [M]), each row's amax / 448 (at least
    1e-12). Bit-identical to fp8route.schemes.quantize_activation(x, "channel")."""
    _check_rows("quantize_per_token", x)
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        key = (x.dtype, *int_key(k, x.stride(0)))
        _ROWS((m,), key, (x, q, scale, k, x.stride(0)), _ROWS_META)
    return q, scale


def quantize_per_group(x: torch.Tensor, m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized per 1x128 group (the last one partial when 128 does not divide K): (e4m3
    [M, K], fp32 scales [M, ceil(K/128)]), bit-identical to fp8route.schemes.quantize_activation(x,
    "block"). m_major: the scales stored M-contiguous, M padded to a multiple of 4, as cuBLASLt's
    1x128 recipe reads them (a transposed view; the values are the same)."""
    _check_rows("quantize_per_group", x)
    m, k = x.shape
    groups = cdiv(k, BLOCK)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    if m_major:
        scale = torch.empty((groups, cdiv(m, 4) * 4), dtype=torch.float32, device=x.device)[:, :m].t()
    else:
        scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        args = (x, q, scale, k, x.stride(0), scale.stride(0), scale.stride(1))
        key = (x.dtype, m_major, *int_key(k, x.stride(0), scale.stride(0), scale.stride(1)))
        _GROUPS_LAUNCHER((m, cdiv(groups, _GROUPS)), key, args, _GROUPS_META)
    return q, scale
