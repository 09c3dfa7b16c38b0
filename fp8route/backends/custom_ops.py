"""torch.library custom ops around every GEMM we route to.

Opaque ops keep torch.compile from tracing into a kernel or swapping it for one of its own
templates: the kernel the plan chose is the kernel that runs. Each has a fake implementation
so compiled graphs and CUDA-graph capture see shapes without running anything.

Backends call `scaled_mm`, `decode_gemm`, ...: the op (`*_op`) while torch.compile traces, the
function itself in eager mode, where the op's dispatcher would add more host time per call than
a decode-sized GEMM takes (docs/routing.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fp8route.schemes import dequantize_weight, scaled_matmul


def eager_or_op(op: Callable[..., Any], impl: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        return op(*args) if torch.compiler.is_compiling() else impl(*args)

    call.__name__ = call.__qualname__ = impl.__name__.lstrip("_")
    call.__doc__ = impl.__doc__
    return call


def _empty_out(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


def _scaled_mm(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """torch._scaled_mm: scalar scales run cuBLASLt, (M,1)/(1,N) scales the rowwise CUTLASS kernel."""
    # cuBLASLt takes no bias with an fp32 output, so it is added afterwards there.
    fused_bias = bias if out_dtype != torch.float32 else None
    out = torch._scaled_mm(
        x_q,
        weight.t(),
        scale_a=x_scale,
        scale_b=w_scale,
        bias=fused_bias,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )
    if bias is not None and fused_bias is None:
        out = out + bias
    return out


scaled_mm_op = torch.library.custom_op("fp8route::scaled_mm", _scaled_mm, mutates_args=())
scaled_mm = eager_or_op(scaled_mm_op, _scaled_mm)


@scaled_mm_op.register_fake
def _(x_q, weight, x_scale, w_scale, bias, out_dtype, fast_accum):  # type: ignore[no-untyped-def]
    return _empty_out(x_q, weight, out_dtype)


def _reference_mm(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    scheme: str = "tensor",
) -> torch.Tensor:
    """The numeric oracle: the scheme's fp32 product (fp8route.schemes.scaled_matmul), one rounding at
    the end. w_scale None: a block weight already multiplied by its scales."""
    out = scaled_matmul(x_q, x_scale, weight, w_scale, scheme)  # type: ignore[arg-type]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


reference_mm_op = torch.library.custom_op("fp8route::reference_mm", _reference_mm, mutates_args=())
reference_mm = eager_or_op(reference_mm_op, _reference_mm)


@reference_mm_op.register_fake
def _(x_q, weight, x_scale, w_scale, bias, out_dtype, scheme="tensor"):  # type: ignore[no-untyped-def]
    return _empty_out(x_q, weight, out_dtype)


def _weight_only_mm(
    x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, scheme: str = "tensor"
) -> torch.Tensor:
    """For GPUs without FP8 tensor cores: the weight dequantized per call, x as it is.

    Dequantizing per call keeps one byte per weight in memory instead of two; x is not
    quantized, so results are closer to full precision than the FP8 path, not equal to it.
    """
    b = None if bias is None else bias.to(x.dtype)
    if scheme == "block":  # the scales do not factor out of the K sum
        return torch.nn.functional.linear(x, dequantize_weight(weight, w_scale, "block").to(x.dtype), b)
    if scheme == "channel":
        out = torch.nn.functional.linear(x, weight.to(x.dtype)).float() * w_scale
        return (out if b is None else out + b.float()).to(x.dtype)
    # Scaling x rather than the weight keeps the scale in fp32 (a bf16 scale would bias every
    # output by up to 0.4%) and keeps fp16 sums in range. e4m3 values are exact in bf16/fp16.
    x_scaled = (x.float() * w_scale).to(x.dtype)
    return torch.nn.functional.linear(x_scaled, weight.to(x.dtype), b)


weight_only_mm_op = torch.library.custom_op("fp8route::weight_only_mm", _weight_only_mm, mutates_args=())
weight_only_mm = eager_or_op(weight_only_mm_op, _weight_only_mm)


@weight_only_mm_op.register_fake
def _(x, weight, w_scale, bias, scheme="tensor"):  # type: ignore[no-untyped-def]
    return _empty_out(x, weight, x.dtype)


def _flashinfer_bmm(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """FlashInfer's bmm_fp8 on its cuBLAS backend, as a batch of one."""
    from flashinfer import bmm_fp8

    m, n = x_q.shape[0], weight.shape[0]
    # weight [N, K] row-major is the column-major [K, N] operand bmm_fp8 expects.
    out = bmm_fp8(
        x_q.unsqueeze(0),
        weight.t().unsqueeze(0),
        x_scale.reshape(1),
        w_scale.reshape(1),
        out_dtype,
        backend="cublas",
    )
    return out.view(m, n)


flashinfer_bmm_op = torch.library.custom_op("fp8route::flashinfer_bmm", _flashinfer_bmm, mutates_args=())
flashinfer_bmm = eager_or_op(flashinfer_bmm_op, _flashinfer_bmm)


@flashinfer_bmm_op.register_fake
def _(x_q, weight, x_scale, w_scale, out_dtype):  # type: ignore[no-untyped-def]
    return _empty_out(x_q, weight, out_dtype)


def _decode_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    scheme: str = "tensor",
) -> torch.Tensor:
    """fp8route's decode GEMM; in the tensor scheme x in bf16/fp16 is quantized with x_scale inside it,
    e4m3 x was quantized with it already; in the channel and block schemes (x_scale None) it quantizes
    x per token or group itself."""
    from fp8route.kernels.decode_gemm.launch import launch

    return launch(x.contiguous(), weight, w_scale, x_scale, bias, out_dtype, scheme=scheme)


decode_gemm_op = torch.library.custom_op("fp8route::decode_gemm", _decode_gemm, mutates_args=())
decode_gemm = eager_or_op(decode_gemm_op, _decode_gemm)


@decode_gemm_op.register_fake
def _(x, weight, w_scale, x_scale, bias, out_dtype, scheme="tensor"):  # type: ignore[no-untyped-def]
    return _empty_out(x, weight, out_dtype)


def _block_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """fp8route's block-scaled GEMM: x bf16/fp16 quantized per 1x128 group inside it (x_scale None),
    or e4m3 with its [M, ceil(K/128)] scales."""
    from fp8route.kernels.block_gemm import launch

    return launch(x.contiguous(), weight, w_scale, bias, out_dtype, x_scale=x_scale)


block_gemm_op = torch.library.custom_op("fp8route::block_gemm", _block_gemm, mutates_args=())
block_gemm = eager_or_op(block_gemm_op, _block_gemm)


@block_gemm_op.register_fake
def _(x, weight, w_scale, x_scale, bias, out_dtype):  # type: ignore[no-untyped-def]
    return _empty_out(x, weight, out_dtype)


def _flashinfer_block(
    x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """FlashInfer's SM90 block-scaled GEMM, bf16 x quantized per 1x128 group inside it."""
    from flashinfer.gemm import fp8_blockscale_gemm_sm90

    return fp8_blockscale_gemm_sm90(x, weight, None, w_scale, out_dtype=out_dtype)


flashinfer_block_op = torch.library.custom_op("fp8route::flashinfer_block", _flashinfer_block, mutates_args=())
flashinfer_block = eager_or_op(flashinfer_block_op, _flashinfer_block)


@flashinfer_block_op.register_fake
def _(x, weight, w_scale, out_dtype):  # type: ignore[no-untyped-def]
    return _empty_out(x, weight, out_dtype)


def _fixed_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor | None,
    w_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tiles: list[int] | None = None,
) -> torch.Tensor:
    """fp8route's fixed-tile GEMM (the deterministic mode's): e4m3 x and weight with their scales, or
    16-bit x and weight with none; each output row the same bits whatever M is. tiles: a FixedTiles'
    fields in order (None: the default tiling)."""
    from fp8route.kernels.fixed_gemm import FixedTiles, launch

    return launch(x, weight, x_scale, w_scale, bias, out_dtype, FixedTiles.from_ints(tiles) if tiles else None)


fixed_gemm_op = torch.library.custom_op("fp8route::fixed_gemm", _fixed_gemm, mutates_args=())
fixed_gemm = eager_or_op(fixed_gemm_op, _fixed_gemm)


@fixed_gemm_op.register_fake
def _(x, weight, x_scale, w_scale, bias, out_dtype, tiles=None):  # type: ignore[no-untyped-def]
    return _empty_out(x, weight, out_dtype)
