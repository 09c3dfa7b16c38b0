"""Per-tensor torch._scaled_mm: cuBLASLt with scalar scales (the seed's new path)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fp8route import ops
from fp8route.backends.base import Backend, bias_as, first_reason, needs_aligned, needs_fp8_gpu
from fp8route.problem import GemmProblem

if TYPE_CHECKING:
    from fp8route.layer import Fp8Linear


class CublasBackend(Backend):
    def __init__(self, fast_accum: bool = False) -> None:
        self.fast_accum = fast_accum
        self.name = "cublas_fast" if fast_accum else "cublas"
        # Fast accumulation skips the periodic promotion of the FP8 tensor-core accumulator to
        # fp32: -5 to -8% time at M >= 512 on most 8B shapes on the H200, slower on a few.
        self.summary = "torch._scaled_mm, per-tensor scales (cuBLASLt)" + (", fast accumulation" if fast_accum else "")

    def why_not(self, problem: GemmProblem) -> str | None:
        return first_reason(needs_fp8_gpu(problem), needs_aligned(problem))

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, layer: Fp8Linear, out_dtype: torch.dtype
    ) -> torch.Tensor:
        return ops.scaled_mm(
            x_q, layer.weight, x_scale, layer.weight_scale, bias_as(layer, out_dtype), out_dtype, self.fast_accum
        )
