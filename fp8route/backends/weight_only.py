"""For GPUs without FP8 tensor cores (SM 8.0-8.6): a bf16/fp16 matmul on the dequantized weight."""

from __future__ import annotations

import torch

from fp8route.backends import custom_ops
from fp8route.backends.base import Backend, LinearOperands
from fp8route.backends.problem import GemmProblem
from fp8route.schemes import SCHEMES, dequantize_activation


class WeightOnlyBackend(Backend):
    name = "weight_only"
    summary = "dequantized weight, matmul in the activation dtype (x not quantized)"
    schemes = frozenset(SCHEMES)

    def why_not(self, problem: GemmProblem) -> str | None:
        device = problem.device
        if device.type != "cuda":
            runs_there = "cpu_dequant" if device.type == "cpu" else "reference"
            return f"meant for GPUs, layer is on {device.type} ({runs_there} runs there)"
        assert device.capability is not None
        if device.capability < (8, 0) and problem.out_dtype == torch.bfloat16:
            major, minor = device.capability
            return f"bfloat16 matmul needs compute capability >= 8.0, device has {major}.{minor}"
        return None

    def run(self, x: torch.Tensor, operands: LinearOperands) -> torch.Tensor:
        return custom_ops.weight_only_mm(x, operands.weight, operands.weight_scale, operands.bias, operands.scheme)

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        x = dequantize_activation(x_q, x_scale, operands.scheme).to(out_dtype)  # what the FP8 path multiplies too
        return custom_ops.weight_only_mm(x, operands.weight, operands.weight_scale, operands.bias, operands.scheme)
