"""The reference's math on a CPU, with the weight dequantized once at plan time instead of per call."""

from __future__ import annotations

import torch

from fp8route.backends import custom_ops
from fp8route.backends.base import DEQUANTIZED, TENSOR, Backend, LinearOperands
from fp8route.backends.problem import GemmProblem
from fp8route.schemes import SCHEMES


class CpuDequantBackend(Backend):
    """x is still quantized to e4m3 with the layer's input scale on every call; the weight's copy
    holds its e4m3 values as fp32 (exact), so reference_mm runs the very same fp32 matmul on it
    and the output is the reference backend's."""

    name = "cpu_dequant"
    summary = "weight dequantized to fp32 once at plan time, x quantized per call, fp32 matmul (CPU)"
    layouts = frozenset({TENSOR, DEQUANTIZED})
    schemes = frozenset(SCHEMES)

    def why_not(self, problem: GemmProblem) -> str | None:
        if problem.device.type != "cpu":
            return f"meant for CPUs, layer is on {problem.device.type} (its fp32 weight copy is 4x the e4m3 weight)"
        return None

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        o = operands
        assert o.weight_dequantized is not None, "the plan prepares the dequantized layout for cpu_dequant"
        w_scale = None if o.scheme == "block" else o.weight_scale  # the block copy holds its scales
        return custom_ops.reference_mm(x_q, o.weight_dequantized, x_scale, w_scale, o.bias, out_dtype, o.scheme)
