"""Dequantize both operands and multiply in fp32: the numeric oracle, and what a CPU runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fp8route import ops
from fp8route.backends.base import Backend
from fp8route.problem import GemmProblem

if TYPE_CHECKING:
    from fp8route.layer import Fp8Linear


class ReferenceBackend(Backend):
    name = "reference"
    summary = "dequantize + fp32 matmul (any device; the numeric oracle)"

    def why_not(self, problem: GemmProblem) -> str | None:
        return None

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, layer: Fp8Linear, out_dtype: torch.dtype
    ) -> torch.Tensor:
        return ops.reference_mm(x_q, layer.weight, x_scale, layer.weight_scale, layer.bias, out_dtype)
