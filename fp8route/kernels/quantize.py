"""Static per-tensor activation quantization to e4m3 in one Triton pass, and the device function
every fused kernel shares so that fused and standalone quantization give the same bits."""

from __future__ import annotations

import torch

from fp8route.errors import Fp8InputError
from fp8route.kernels.launcher import DirectLauncher
from fp8route.kernels.triton_support import tl, triton
from fp8route.quant import FP8_DTYPE

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

    _BLOCK = 1024
    _META = {"BLOCK": _BLOCK, "num_warps": 4}
    _LAUNCHER = DirectLauncher(_quantize_kernel, pointers=3, pdl=True)


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
