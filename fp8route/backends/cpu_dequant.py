"""The reference's math on a CPU, with the weight dequantized once at plan time instead of per call."""

from __future__ import annotations

from dataclasses import replace

import torch

from fp8route.backends import custom_ops
from fp8route.backends.base import DEQUANTIZED, TENSOR, Backend, LinearOperands
from fp8route.backends.problem import GemmProblem
from fp8route.row_tiles import ROW_TILE, by_row_tiles
from fp8route.schemes import SCHEMES, quantize_activation


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

    def batch_variance(self, problem: GemmProblem) -> str | None:
        return "torch's CPU GEMM picks its kernel by M: a lone row runs as a GEMV"


class CpuTilesBackend(CpuDequantBackend):
    """cpu_dequant's product in fixed tiles of ROW_TILE rows (fp8route.row_tiles): every row's result
    is the same bits whatever else shares the call, at the cost of padding small batches."""

    name = "cpu_tiles"
    summary = (
        f"cpu_dequant in fixed {ROW_TILE}-row tiles, a dynamic per-tensor input scale taken per token: "
        "a row's result does not depend on M (CPU)"
    )

    def run(self, x: torch.Tensor, operands: LinearOperands) -> torch.Tensor:
        if operands.scheme == "tensor" and operands.input_scale is None:
            # A dynamic per-tensor scale is the amax of the whole batch; each row's own amax is not.
            x_q, x_scale = quantize_activation(x, "channel")
            n = operands.weight.shape[0]
            per_row = replace(operands, scheme="channel", weight_scale=operands.weight_scale.expand(n))
            return self.run_quantized(x_q, x_scale, per_row, x.dtype)
        return super().run(x, operands)

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        run = super().run_quantized
        if x_scale.dim() == 0:  # one scale for every row (per tensor)
            return by_row_tiles(lambda tile: run(tile, x_scale, operands, out_dtype), x_q)
        return by_row_tiles(lambda tile, scale: run(tile, scale, operands, out_dtype), x_q, x_scale)

    def batch_variance(self, problem: GemmProblem) -> str | None:
        return None
