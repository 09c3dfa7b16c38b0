"""FlashInfer's bmm_fp8 on its cuBLAS backend (cuBLASLt with fast accumulation), when installed."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from fp8route import ops
from fp8route.backends.base import Backend, bias_as, first_reason, needs_aligned, needs_fp8_gpu
from fp8route.problem import GemmProblem

if TYPE_CHECKING:
    from fp8route.layer import Fp8Linear


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


class FlashinferBackend(Backend):
    name = "flashinfer"
    summary = "flashinfer.bmm_fp8(backend='cublas'), per-tensor scales"

    def why_not(self, problem: GemmProblem) -> str | None:
        if not flashinfer_installed():
            return "flashinfer is not installed (pip install 'fp8route[flashinfer]')"
        reason = first_reason(needs_fp8_gpu(problem), needs_aligned(problem))
        if reason is None and problem.out_dtype not in (torch.bfloat16, torch.float16):
            return "writes bfloat16 or float16 output only"
        return reason

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, layer: Fp8Linear, out_dtype: torch.dtype
    ) -> torch.Tensor:
        out = ops.flashinfer_bmm(x_q, layer.weight, x_scale, layer.weight_scale, out_dtype)
        return out if layer.bias is None else out + bias_as(layer, out_dtype)
