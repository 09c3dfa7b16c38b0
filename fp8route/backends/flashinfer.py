"""FlashInfer's bmm_fp8 on its cuBLAS backend (cuBLASLt with fast accumulation), when installed."""

from __future__ import annotations

import importlib.util

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


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


class FlashinferBackend(Backend):
    name = "flashinfer"
    summary = "flashinfer.bmm_fp8(backend='cublas'), per-tensor scales"

    def why_not(self, problem: GemmProblem) -> str | None:
        if not flashinfer_installed():
            return "flashinfer is not installed (pip install 'fp8route[flashinfer]')"
        reason = first_reason(needs_scheme(problem, self.schemes), needs_fp8_gpu(problem), needs_aligned(problem))
        if reason is None and problem.out_dtype not in (torch.bfloat16, torch.float16):
            return "writes bfloat16 or float16 output only"
        return reason

    def x_quant(self, scheme: Scheme) -> XQuant | None:
        return XQuant("tensor")

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        out = custom_ops.flashinfer_bmm(x_q, operands.weight, x_scale, operands.weight_scale, out_dtype)
        return out if operands.bias is None else out + bias_as(operands, out_dtype)
