"""The block scheme's GEMMs (128x128 weight blocks, 1x128 activation groups): cuBLASLt through
torch._scaled_mm's blockwise recipe, fp8route's Triton kernel (x quantized by a separate kernel, or
inside the GEMM), and FlashInfer's SM90 kernel when installed. fp8_gemv (the decode GEMM) serves the
scheme too, for small M."""

from __future__ import annotations

import torch

from fp8route.backends import custom_ops
from fp8route.backends.base import (
    BLOCK_KMAJOR,
    Backend,
    LinearOperands,
    bias_as,
    first_reason,
    needs_aligned,
    needs_fp8_gpu,
    needs_scheme,
    quantize_input,
)
from fp8route.backends.flashinfer import flashinfer_installed
from fp8route.backends.problem import GemmProblem
from fp8route.kernels.fused_quantize import XQuant
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR
from fp8route.schemes import Scheme

_BLOCK = frozenset({"block"})
_HALF = (torch.bfloat16, torch.float16)


def _torch_has_blockwise() -> bool:
    """torch 2.9+ built against CUDA 12.9+ runs _scaled_mm's 1x128 x 128x128 recipe on SM90."""
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return version >= (2, 9) and cuda >= (12, 9)


class CublasBlockBackend(Backend):
    name = "cublas_block"
    summary = "torch._scaled_mm, 1x128 x 128x128 block scales (cuBLASLt)"
    layouts = frozenset({BLOCK_KMAJOR})
    schemes = _BLOCK

    def why_not(self, problem: GemmProblem) -> str | None:
        reason = first_reason(needs_scheme(problem, self.schemes), needs_fp8_gpu(problem), needs_aligned(problem))
        if reason is not None:
            return reason
        if problem.device.capability != (9, 0):
            return "cuBLASLt's 1x128 x 128x128 recipe runs on SM 9.0 only"
        if problem.n % 128 or problem.k % 512:
            # Whole blocks only (partial edge blocks: not yet run on a GPU). And K/128 a multiple of 4:
            # torch 2.11 refused the K-major weight scales of K=256 padded to a stride of 4 ("Invalid
            # scaling configuration", H100), while other torch versions want that padding.
            return f"N={problem.n} must be a multiple of 128 and K={problem.k} of 512 (whole blocks, 4 to a scale row)"
        if not _torch_has_blockwise():
            return f"needs torch >= 2.9 built with CUDA >= 12.9, have {torch.__version__} (CUDA {torch.version.cuda})"
        if problem.out_dtype != torch.bfloat16:
            return "writes bfloat16 output only"
        return None

    def x_quant(self, scheme: Scheme) -> XQuant | None:
        return XQuant("block", m_major=True, rows=4)

    def run(self, x: torch.Tensor, operands: LinearOperands) -> torch.Tensor:
        m = x.shape[0]
        if m % 4:
            # cuBLASLt refused M=1 and M=2 ("Invalid scaling configuration" on the H200, M=4 and up
            # ran): zero rows up to a multiple of 4, sliced off after.
            x = torch.nn.functional.pad(x, (0, 0, 0, 4 - m % 4))
        x_q, x_scale = quantize_input(x, operands, m_major=True)
        return self.run_quantized(x_q, x_scale, operands, x.dtype)[:m]

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        assert operands.weight_scale_kmajor is not None, "the plan prepares the K-major block scales"
        o = operands
        return custom_ops.scaled_mm(
            x_q, o.weight, x_scale, o.weight_scale_kmajor, bias_as(o, out_dtype), out_dtype, False
        )


class TritonBlockBackend(Backend):
    """fused: x quantized per group inside the GEMM (every column tile quantizes the tiles of x it
    reads again); else by one quantizer kernel first, the GEMM reading e4m3 x and its scales."""

    schemes = _BLOCK

    def __init__(self, fused: bool) -> None:
        self.fused = fused
        self.name = "triton_block_fused" if fused else "triton_block"
        self.summary = "fp8route's Triton block-scaled GEMM, " + (
            "x quantized per group inside it" if fused else "x quantized per group by a kernel before it"
        )

    def why_not(self, problem: GemmProblem) -> str | None:
        reason = first_reason(needs_scheme(problem, self.schemes), needs_fp8_gpu(problem), TRITON_IMPORT_ERROR)
        if reason is None and problem.k % 16:
            return f"K={problem.k} is not a multiple of 16 (16-byte fp8 weight rows)"
        if reason is None and problem.out_dtype not in _HALF:
            return "writes bfloat16 or float16 output only"
        return reason

    def x_quant(self, scheme: Scheme) -> XQuant | None:
        return None if self.fused else XQuant("block")

    def run(self, x: torch.Tensor, operands: LinearOperands) -> torch.Tensor:
        if self.fused and x.dtype in _HALF:
            o = operands
            return custom_ops.block_gemm(x, o.weight, o.weight_scale, None, bias_as(o, x.dtype), x.dtype)
        return super().run(x, operands)

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        o = operands
        return custom_ops.block_gemm(x_q, o.weight, o.weight_scale, x_scale, bias_as(o, out_dtype), out_dtype)


class FlashinferBlockBackend(Backend):
    name = "flashinfer_block"
    summary = "flashinfer.gemm.fp8_blockscale_gemm_sm90, bf16 x quantized per group inside it"
    schemes = _BLOCK

    def why_not(self, problem: GemmProblem) -> str | None:
        if not flashinfer_installed():
            return "flashinfer is not installed (pip install 'fp8route[flashinfer]')"
        reason = first_reason(needs_scheme(problem, self.schemes), needs_fp8_gpu(problem))
        if reason is not None:
            return reason
        if problem.device.capability != (9, 0):
            return "FlashInfer's block-scaled kernel is built for SM 9.0 only"
        if problem.n % 128 or problem.k % 128:
            return f"N={problem.n} and K={problem.k} must be multiples of 128 (whole blocks)"
        if problem.out_dtype != torch.bfloat16:
            return "reads and writes bfloat16 only"
        return None

    def run(self, x: torch.Tensor, operands: LinearOperands) -> torch.Tensor:
        o = operands
        out = custom_ops.flashinfer_block(x.contiguous(), o.weight, o.weight_scale, x.dtype)
        return out if o.bias is None else out + bias_as(o, x.dtype)

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        raise NotImplementedError("flashinfer_block quantizes bf16 x itself; the block scheme has no x handed over")
