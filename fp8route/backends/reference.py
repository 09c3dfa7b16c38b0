"""Dequantize both operands on every call and multiply in fp32: the numeric oracle, and what runs
where nothing else can (a CPU runs the same math through cpu_dequant)."""

from __future__ import annotations

import torch

from fp8route.backends import custom_ops
from fp8route.backends.base import Backend, LinearOperands
from fp8route.backends.problem import GemmProblem
from fp8route.schemes import SCHEMES


class ReferenceBackend(Backend):
    name = "reference"
    summary = "dequantize + fp32 matmul (any device; the numeric oracle)"
    schemes = frozenset(SCHEMES)

    def why_not(self, problem: GemmProblem) -> str | None:
        return None

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        o = operands
        return custom_ops.reference_mm(x_q, o.weight, x_scale, o.weight_scale, o.bias, out_dtype, o.scheme)
