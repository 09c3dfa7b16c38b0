"""Our Triton decode kernel: activation quantization fused into a deterministic split-K GEMM."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

from fp8route import ops
from fp8route.backends.base import Backend, bias_as, first_reason, needs_fp8_gpu
from fp8route.problem import GemmProblem

if TYPE_CHECKING:
    from fp8route.layer import Fp8Linear


def _kernel() -> ModuleType:
    # Imported on first use: importing triton costs most of a second and CPU installs lack it.
    from fp8route.kernels import fp8_gemv

    return fp8_gemv


class Fp8GemvBackend(Backend):
    name = "fp8_gemv"
    summary = "fp8route's Triton kernel: x quantized inside, split-K, for decode-sized M"

    def why_not(self, problem: GemmProblem) -> str | None:
        reason = needs_fp8_gpu(problem)
        if reason is not None:
            return reason
        kernel = _kernel()
        if not problem.static_input_scale:
            return "needs a static input_scale (it quantizes x inside the kernel)"
        if problem.out_dtype not in kernel.OUT_DTYPES:
            return "writes bfloat16 or float16 output only"
        if problem.m_max is None or problem.m_max > kernel.M_MAX:
            return f"built for M <= {kernel.M_MAX}"
        return first_reason(kernel.why_not(problem.m_max, problem.n, problem.k))

    def run(self, x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
        assert layer.input_scale is not None, "the plan only picks fp8_gemv for a static input scale"
        return ops.fp8_gemv(x, layer.weight, layer.weight_scale, layer.input_scale, bias_as(layer, x.dtype), x.dtype)

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, layer: Fp8Linear, out_dtype: torch.dtype
    ) -> torch.Tensor:
        return ops.fp8_gemv(x_q, layer.weight, layer.weight_scale, x_scale, bias_as(layer, out_dtype), out_dtype)
