"""The kernels before a GEMM that hand it x already quantized: RMSNorm (after the residual add or
alone) and SiLU-times-up, each writing e4m3 x as the next layer's scheme reads it (fp8route.schemes:
with its static per-tensor scale, or per token or per 1x128 group with the scales it writes),
instead of a bf16 x that a quantizer kernel reads again. The bits are those of the unfused pair: the
value is rounded to the activation dtype first, then quantized by the same device functions as
fp8route.kernels.quantize's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from fp8route.kernels.launcher import DirectLauncher, int_key
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR, tl, triton
from fp8route.quant import FP8_DTYPE
from fp8route.schemes import BLOCK, Scheme, cdiv

_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class XQuant:
    """How a GEMM reads an x quantized ahead of it: with the layer's static input_scale (tensor), per
    token (channel) or per 1x128 group (block); m_major: the group scales stored M-contiguous; rows:
    x's rows padded with zeros to a multiple of this (cuBLASLt's 1x128 recipe wants both). input_scale:
    the layer's, which a backend's ask leaves to the layer (Fp8Linear.x_quant); not part of a kernel's
    key, so that every layer's launches share one compiled kernel."""

    scheme: Scheme
    m_major: bool = False
    rows: int = 1
    input_scale: torch.Tensor | None = field(default=None, compare=False)


@dataclass(frozen=True)
class QuantizedX:
    """An activation x [..., K] quantized for the GEMM after it: q [R, K] e4m3 with R the rows of x
    padded as its XQuant says; scale the static one (per tensor), [R] per token or [R, ceil(K/128)] per
    group; shape and dtype are x's (the GEMM's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.shape.numel() // self.shape[-1] if len(self.shape) else 0


def fusable(x: torch.Tensor) -> bool:
    """Whether the fused kernels run on x: a contiguous 16-bit CUDA tensor outside torch.compile (else
    the caller runs the unfused pair and asks for nothing)."""
    return (
        x.is_cuda
        and x.dtype in _HALF
        and x.is_contiguous()
        and TRITON_IMPORT_ERROR is None
        and not torch.compiler.is_compiling()
    )


def _outputs(rows: int, k: int, spec: XQuant, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    padded = cdiv(rows, spec.rows) * spec.rows
    q = torch.empty((padded, k), dtype=FP8_DTYPE, device=device)
    if spec.scheme == "tensor":
        assert spec.input_scale is not None, "a static per-tensor quantization takes the layer's input_scale"
        return q, spec.input_scale
    if spec.scheme == "channel":
        return q, torch.empty((padded,), dtype=torch.float32, device=device)
    groups = cdiv(k, BLOCK)
    if spec.m_major:
        stored = cdiv(padded, 4) * 4
        return q, torch.empty((groups, stored), dtype=torch.float32, device=device)[:, :padded].t()
    return q, torch.empty((padded, groups), dtype=torch.float32, device=device)


def _scale_strides(spec: XQuant, scale: torch.Tensor) -> tuple[int, int]:
    return (scale.stride(0), scale.stride(1)) if spec.scheme == "block" else (scale.stride(0) if scale.dim() else 0, 0)


def rms_norm_quantized(x: torch.Tensor, weight: torch.Tensor, eps: float, spec: XQuant) -> QuantizedX:
    """rms_norm(x, weight, eps) quantized as spec says, in one kernel; x fusable."""
    return _norm(x, None, weight, eps, spec)[0]


def add_rms_norm_quantized(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, spec: XQuant
) -> tuple[QuantizedX, torch.Tensor]:
    """add_rms_norm(x, residual, weight, eps) with the normalized sum quantized as spec says: (that,
    x + residual), in one kernel; x fusable, residual contiguous in x's dtype."""
    quantized, total = _norm(x, residual, weight, eps, spec)
    assert total is not None
    return quantized, total


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, spec: XQuant
) -> tuple[QuantizedX, torch.Tensor | None]:
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    q, scale = _outputs(rows.shape[0], width, spec, x.device)
    total = None if residual is None else torch.empty_like(rows)
    m = rows.shape[0]
    stride_sm, stride_sg = _scale_strides(spec, scale)
    args = (rows, rows if residual is None else residual.reshape(-1, width), weight, q, scale,
            rows if total is None else total, m, width, stride_sm, stride_sg, eps)  # fmt: skip
    key = (x.dtype, weight.dtype, spec, residual is not None, *int_key(m, width, stride_sm, stride_sg), eps)
    _NORM((q.shape[0],), key, args, _norm_meta(width, spec.scheme, residual is not None))
    return QuantizedX(q, scale, x.shape, x.dtype), None if total is None else total.reshape(x.shape)


def silu_mul_quantized(gate_up: torch.Tensor, width: int, spec: XQuant) -> QuantizedX:
    """silu_mul(gate_up, width) quantized with a static scale or per 1x128 group, in one kernel; gate_up
    fusable. Not per token: a row's scale needs the whole product row first, so no pass is saved there."""
    if spec.scheme == "channel":
        raise ValueError("silu_mul_quantized quantizes with a static scale or per 1x128 group, not per token")
    rows = gate_up.reshape(-1, 2 * width)
    q, scale = _outputs(rows.shape[0], width, spec, gate_up.device)
    args = (rows, q, scale, rows.shape[0], rows.stride(0), width, *_scale_strides(spec, scale))
    key = (gate_up.dtype, spec, *int_key(*args[3:]))
    grid = (q.shape[0], cdiv(width, _SILU_GROUPS * BLOCK))
    _SILU_MUL_QUANT(grid, key, args, _silu_meta(spec.scheme))
    return QuantizedX(q, scale, torch.Size((*gate_up.shape[:-1], width)), gate_up.dtype)


_SILU_GROUPS = 8  # 1024 columns a program, as silu_mul's block
_QUANT = {"tensor": 0, "channel": 1, "block": 2}  # the kernels' QUANT: a static scale, per token, per group


@functools.cache
def _silu_meta(scheme: Scheme) -> dict[str, int]:
    return {"GROUPS": _SILU_GROUPS, "QUANT": _QUANT[scheme], "num_warps": 4}


@functools.cache
def _norm_meta(width: int, scheme: Scheme, add: bool) -> dict[str, int | bool]:
    return {"BLOCK": max(BLOCK, triton.next_power_of_2(width)), "QUANT": _QUANT[scheme], "ADD": add, "num_warps": 4}


if triton is not None:
    from fp8route.kernels.pdl import wait_for_inputs
    from fp8route.kernels.quantize import dynamic_scale, quantize_e4m3

    BLOCK_GROUP: tl.constexpr = tl.constexpr(BLOCK)

    @triton.jit
    def _row(x_ptr, r_ptr, offs, mask, ADD: tl.constexpr):
        """A row's x (plus its residual, the sum rounded to x's dtype) at offs, in fp32."""
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ADD:
            x = (x + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        return x.to(tl.float32)

    @triton.jit
    def _weighted(x, inv, x_ptr, w_ptr, cols, mask, width):
        """weight * (x * inv), the weight and each product rounded to x's dtype as rms_norm rounds them;
        masked elements +0 (padded rows quantize as zero rows)."""
        dt = x_ptr.dtype.element_ty
        normed = (x * inv).to(dt).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(dt).to(tl.float32)
        return tl.where(mask, (w * normed).to(dt).to(tl.float32), 0.0)

    @triton.jit
    def _norm_quant_kernel(
        x_ptr, r_ptr, w_ptr, q_ptr, scale_ptr, sum_ptr, M, width, stride_sm, stride_sg, eps,
        BLOCK: tl.constexpr, QUANT: tl.constexpr, ADD: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """One program a row (rows past M: padding, quantized as zeros): the row (plus its residual,
        the sum stored), normalized, weighted, rounded to x's dtype, quantized (QUANT 0: with the
        static scale at scale_ptr; 1: per token, 2: per group, the scales stored there). Per group
        the row is read again as [groups, 128] (a 1-D row reshaped to groups ran 5-8x slower than the
        unfused pair on an H100) and takes the 1-D pass's inv: elementwise the same arithmetic."""
        wait_for_inputs(USE_PDL)
        row = tl.program_id(0).to(tl.int64)  # row * width passes 2^31 in a large prefill
        offs = tl.arange(0, BLOCK)
        mask = offs < tl.where(row < M, width, 0)
        x = _row(x_ptr + row * width, r_ptr + row * width, offs, mask, ADD)
        if ADD:
            tl.store(sum_ptr + row * width + offs, x.to(x_ptr.dtype.element_ty), mask=mask)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
        q_row = q_ptr + row * width
        if QUANT == 2:
            groups = tl.arange(0, BLOCK // BLOCK_GROUP)
            cols = groups[:, None] * BLOCK_GROUP + tl.arange(0, BLOCK_GROUP)[None, :]
            mask2 = cols < tl.where(row < M, width, 0)
            x2 = _row(x_ptr + row * width, r_ptr + row * width, cols, mask2, ADD)
            v2 = _weighted(x2, inv, x_ptr, w_ptr, cols, mask2, width)
            s = dynamic_scale(tl.max(tl.abs(v2), axis=1))
            q = quantize_e4m3(v2, s[:, None], tl.math.div_rn(1.0, s)[:, None])
            tl.store(q_row + cols, q, mask=cols < width)
            tl.store(scale_ptr + row * stride_sm + groups * stride_sg, s, mask=groups * BLOCK_GROUP < width)
        else:
            v = _weighted(x, inv, x_ptr, w_ptr, offs, mask, width)
            if QUANT == 0:
                s = tl.load(scale_ptr)
            else:
                s = dynamic_scale(tl.max(tl.abs(v), axis=0))
                tl.store(scale_ptr + row * stride_sm, s)
            # Stored 8 to a thread, as a bf16 row is: the e4m3 store's own 16-wide vectors would set
            # the row's layout, and with it the order of the sum above (its codes then differed from
            # rms_norm's on an H100; tests/kernels/test_compile_sm90.py holds the layouts equal).
            q = quantize_e4m3(v, s, tl.math.div_rn(1.0, s))
            tl.store(q_row + tl.max_contiguous(offs, 8), q, mask=offs < width)

    @triton.jit
    def _silu_mul_quant_kernel(
        x_ptr, q_ptr, scale_ptr, M, stride_row, width, stride_sm, stride_sg,
        GROUPS: tl.constexpr, QUANT: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """One program per row and GROUPS groups of 128 columns: silu(gate) * up rounded to the
        activation dtype as silu_mul rounds it, quantized with the static scale at scale_ptr (QUANT 0)
        or per group (2), rows past M as zeros."""
        wait_for_inputs(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        cols = groups[:, None] * BLOCK_GROUP + tl.arange(0, BLOCK_GROUP)[None, :]
        mask = cols < tl.where(row < M, width, 0)
        gate = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_row + width + cols, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
        v = (silu * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        if QUANT == 0:
            s = tl.load(scale_ptr)
            tl.store(q_ptr + row * width + cols, quantize_e4m3(v, s, tl.math.div_rn(1.0, s)), mask=cols < width)
        else:
            s = dynamic_scale(tl.max(tl.abs(v), axis=1))
            q = quantize_e4m3(v, s[:, None], tl.math.div_rn(1.0, s)[:, None])
            tl.store(q_ptr + row * width + cols, q, mask=cols < width)
            tl.store(scale_ptr + row * stride_sm + groups * stride_sg, s, mask=groups * BLOCK_GROUP < width)

    _NORM = DirectLauncher(_norm_quant_kernel, pointers=6, pdl=True)
    _SILU_MUL_QUANT = DirectLauncher(_silu_mul_quant_kernel, pointers=3, pdl=True)
