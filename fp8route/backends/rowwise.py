"""torch._scaled_mm with (M,1)/(1,N) fp32 scales: the rowwise CUTLASS kernel. It computes the channel
scheme as it is (per-token x, per-channel weight scales) and the tensor scheme with the weight scale
broadcast to a per-channel vector."""

from __future__ import annotations

import torch

from fp8route.backends import custom_ops
from fp8route.backends.base import (
    CHANNEL,
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

# torch builds its rowwise FP8 CUTLASS kernel for SM89, SM90 and SM100 only.
_BUILT_FOR = ((8, 9), (9, 0), (10, 0))


class RowwiseBackend(Backend):
    name = "rowwise"
    summary = "torch._scaled_mm, per-token x (M,1) and per-channel w (1,N) scales (CUTLASS)"
    layouts = frozenset({CHANNEL})
    schemes = frozenset({"tensor", "channel"})

    def why_not(self, problem: GemmProblem) -> str | None:
        reason = first_reason(needs_scheme(problem, self.schemes), needs_fp8_gpu(problem), needs_aligned(problem))
        if reason is not None:
            return reason
        assert problem.device.capability is not None
        if problem.device.capability not in _BUILT_FOR:
            major, minor = problem.device.capability
            return f"torch's rowwise kernel is built for SM 8.9, 9.0 and 10.0, device has {major}.{minor}"
        if problem.out_dtype != torch.bfloat16:
            return "writes bfloat16 output only"
        return None

    def x_quant(self, scheme: Scheme) -> XQuant | None:
        return XQuant("channel" if scheme == "channel" else "tensor")

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        # A fresh (M, 1) tensor for a scalar: the kernel wants stride 1, even at M=1.
        x_scales = x_scale.reshape(-1, 1) if x_scale.dim() == 1 else x_scale.reshape(1, 1).repeat(x_q.shape[0], 1)
        assert operands.weight_scale_channel is not None, "plan prepares the channel layout"
        return custom_ops.scaled_mm(
            x_q,
            operands.weight,
            x_scales,
            operands.weight_scale_channel,
            bias_as(operands, out_dtype),
            out_dtype,
            False,
        )
