"""Per-tensor torch._scaled_mm: cuBLASLt with scalar scales."""

from __future__ import annotations

import torch

from fp8route.backends import custom_ops
from fp8route.backends.base import (
    Backend,
    LinearOperands,
    bias_as,
    first_reason,
    needs_aligned,
    needs_fp8_gpu,
    needs_scheme,
)
from fp8route.backends.problem import GemmProblem
from fp8route.kernels.fused_quantize import XQuant
from fp8route.schemes import Scheme


class CublasBackend(Backend):
    def __init__(self, fast_accum: bool = False) -> None:
        self.fast_accum = fast_accum
        self.name = "cublas_fast" if fast_accum else "cublas"
        # Fast accumulation skips the periodic promotion of the FP8 tensor-core accumulator to
        # fp32: faster at large M on most shapes, slower on a few (docs/results.md), so it is a
        # backend of its own, out of the default priority, that a routing table picks where it wins.
        self.summary = "torch._scaled_mm, per-tensor scales (cuBLASLt)" + (", fast accumulation" if fast_accum else "")

    def why_not(self, problem: GemmProblem) -> str | None:
        return first_reason(needs_scheme(problem, self.schemes), needs_fp8_gpu(problem), needs_aligned(problem))

    def x_quant(self, scheme: Scheme) -> XQuant | None:
        return XQuant("tensor")

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        return custom_ops.scaled_mm(
            x_q,
            operands.weight,
            x_scale,
            operands.weight_scale,
            bias_as(operands, out_dtype),
            out_dtype,
            self.fast_accum,
        )
