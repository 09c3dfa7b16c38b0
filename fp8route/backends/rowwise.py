"""torch._scaled_mm with (M,1)/(1,N) fp32 scales: the rowwise CUTLASS kernel (the seed's old path)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fp8route import ops
from fp8route.backends.base import CHANNEL, Backend, bias_as, first_reason, needs_aligned, needs_fp8_gpu
from fp8route.problem import GemmProblem

if TYPE_CHECKING:
    from fp8route.layer import Fp8Linear

# torch builds its rowwise FP8 CUTLASS kernel for SM89, SM90 and SM100 only.
_BUILT_FOR = ((8, 9), (9, 0), (10, 0))


class RowwiseBackend(Backend):
    name = "rowwise"
    summary = "torch._scaled_mm, per-token x (M,1) and per-channel w (1,N) scales (CUTLASS)"
    layouts = frozenset({CHANNEL})

    def why_not(self, problem: GemmProblem) -> str | None:
        reason = first_reason(needs_fp8_gpu(problem), needs_aligned(problem))
        if reason is not None:
            return reason
        assert problem.device.capability is not None
        if problem.device.capability not in _BUILT_FOR:
            major, minor = problem.device.capability
            return f"torch's rowwise kernel is built for SM 8.9, 9.0 and 10.0, device has {major}.{minor}"
        if problem.out_dtype != torch.bfloat16:
            return "writes bfloat16 output only"
        return None

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, layer: Fp8Linear, out_dtype: torch.dtype
    ) -> torch.Tensor:
        # A fresh (M, 1) tensor: the kernel wants stride 1, even at M=1.
        x_scales = x_scale.reshape(1, 1).repeat(x_q.shape[0], 1)
        assert layer.weight_scale_channel is not None, "plan prepares the channel layout"
        return ops.scaled_mm(
            x_q, layer.weight, x_scales, layer.weight_scale_channel, bias_as(layer, out_dtype), out_dtype, False
        )
