"""The backend named fp8_gemv: fp8route's decode GEMM (fp8route/kernels/decode_gemm), activation
quantization (static per tensor, dynamic per token or per 1x128 group) fused into a deterministic
split-K GEMM for small M."""

from __future__ import annotations

import torch

from fp8route.backends import custom_ops
from fp8route.backends.base import Backend, LinearOperands, bias_as, needs_fp8_gpu
from fp8route.backends.problem import GemmProblem
from fp8route.kernels.decode_gemm import configs
from fp8route.schemes import SCHEMES

OUT_DTYPES = (torch.bfloat16, torch.float16)


class Fp8GemvBackend(Backend):
    name = "fp8_gemv"
    summary = "fp8route's Triton kernel: x quantized inside, split-K, for decode-sized M"
    schemes = frozenset(SCHEMES)

    def why_not(self, problem: GemmProblem) -> str | None:
        reason = needs_fp8_gpu(problem)
        if reason is not None:
            return reason
        if problem.scheme == "tensor" and not problem.static_input_scale:
            return "needs a static input_scale in the tensor scheme (it quantizes x inside the kernel)"
        if problem.out_dtype not in OUT_DTYPES:
            return "writes bfloat16 or float16 output only"
        if problem.m_max is None or problem.m_max > configs.M_MAX:
            return f"built for M <= {configs.M_MAX}"
        return configs.why_not(problem.m_max, problem.n, problem.k)

    def prepare(self, device: torch.device) -> None:
        if device.type == "cuda":
            from fp8route.kernels.split_counters import reserve_counters

            reserve_counters(device)

    def run(self, x: torch.Tensor, operands: LinearOperands) -> torch.Tensor:
        w = operands
        assert w.scheme != "tensor" or w.input_scale is not None, "the plan picks fp8_gemv for a static input scale"
        return custom_ops.decode_gemm(
            x, w.weight, w.weight_scale, w.input_scale, bias_as(w, x.dtype), x.dtype, w.scheme
        )

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        w = operands
        assert w.scheme == "tensor", "x arrives quantized in the tensor scheme only (forward_quantized)"
        return custom_ops.decode_gemm(x_q, w.weight, w.weight_scale, x_scale, bias_as(w, out_dtype), out_dtype)
