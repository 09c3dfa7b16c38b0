"""The backend named fp8_gemv: fp8route's decode GEMM (fp8route/kernels/decode_gemm), activation
quantization fused into a deterministic split-K GEMM for small M."""

from __future__ import annotations

import torch

from fp8route.backends import custom_ops
from fp8route.backends.base import Backend, LinearOperands, bias_as, needs_fp8_gpu
from fp8route.backends.problem import GemmProblem
from fp8route.kernels.decode_gemm import configs

OUT_DTYPES = (torch.bfloat16, torch.float16)


class Fp8GemvBackend(Backend):
    name = "fp8_gemv"
    summary = "fp8route's Triton kernel: x quantized inside, split-K, for decode-sized M"
    fuses_silu_mul = True

    def why_not(self, problem: GemmProblem) -> str | None:
        reason = needs_fp8_gpu(problem)
        if reason is not None:
            return reason
        if not problem.static_input_scale:
            return "needs a static input_scale (it quantizes x inside the kernel)"
        if problem.out_dtype not in OUT_DTYPES:
            return "writes bfloat16 or float16 output only"
        if problem.m_max is None or problem.m_max > configs.M_MAX:
            return f"built for M <= {configs.M_MAX}"
        return configs.why_not(problem.m_max, problem.n, problem.k)

    def prepare(self, device: torch.device) -> None:
        if device.type == "cuda":
            from fp8route.kernels.decode_gemm.launch import reserve_counters

            reserve_counters(device)

    def run(self, x: torch.Tensor, operands: LinearOperands) -> torch.Tensor:
        assert operands.input_scale is not None, "the plan only picks fp8_gemv for a static input scale"
        return self.run_quantized(x, operands.input_scale, operands, x.dtype)

    def run_silu_mul(self, gate_up: torch.Tensor, operands: LinearOperands) -> torch.Tensor:
        assert operands.input_scale is not None, "the plan only picks fp8_gemv for a static input scale"
        w = operands
        out_dtype = gate_up.dtype
        return custom_ops.decode_gemm(
            gate_up, w.weight, w.weight_scale, w.input_scale, bias_as(w, out_dtype), out_dtype, True
        )

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        # x_q may still be bf16/fp16 (from run): the kernel quantizes it with x_scale inside.
        w = operands
        return custom_ops.decode_gemm(x_q, w.weight, w.weight_scale, x_scale, bias_as(w, out_dtype), out_dtype)
