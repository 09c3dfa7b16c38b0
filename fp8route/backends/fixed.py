"""The deterministic mode's GEMM on a GPU: fp8route's fixed-tile Triton GEMM (fp8route.kernels.fixed_gemm),
whose every output row is the same bits whatever M is, for each FP8 scheme."""

from __future__ import annotations

from dataclasses import replace

import torch

from fp8route.backends import custom_ops
from fp8route.backends.base import Backend, LinearOperands, bias_as, first_reason, needs_fp8_gpu, needs_scheme
from fp8route.backends.problem import GemmProblem
from fp8route.kernels import quantize as triton_quantize
from fp8route.kernels.fixed_gemm import FixedTiles
from fp8route.kernels.fused_quantize import XQuant
from fp8route.kernels.split_counters import reserve_counters
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR
from fp8route.schemes import SCHEMES, Scheme


class FixedTilesBackend(Backend):
    """One tiling of the fixed-tile GEMM: each tiling is a backend of its own, so that the deterministic
    mode can choose per layer and M bucket, by measurement, among the tilings that sum K alike."""

    schemes = frozenset(SCHEMES)

    def __init__(self, name: str, tiles: FixedTiles) -> None:
        self.name, self.tiles = name, tiles
        x = (
            "x quantized inside, with a static scale or per 1x128 group"
            if tiles.quantize_x
            else "a dynamic per-tensor input scale taken per token"
        )
        self.summary = (
            f"fp8route's fixed-tile Triton GEMM ({tiles.block_m}x{tiles.block_n} tiles, K summed in "
            f"{tiles.block_k * tiles.chunk_steps}-wide chunks in order), {x}: a row's result does not depend on M"
        )
        self._tiles = tiles.as_ints()  # the custom op's list[int]
        # x handed over quantized: the same tiles reading it as it is (the same e4m3 x, the same bits).
        self._tiles_quantized = replace(tiles, quantize_x=False).as_ints()
        # What orders a row's sum: the K steps and chunks, not the tile's rows, columns or pipeline.
        self.bits_family = f"fixed-tile GEMM, {tiles.block_k}-wide K steps in chunks of {tiles.chunk_steps}"

    def why_not(self, problem: GemmProblem) -> str | None:
        reason = first_reason(needs_scheme(problem, self.schemes), needs_fp8_gpu(problem), TRITON_IMPORT_ERROR)
        if reason is None and problem.k % 16:
            return f"K={problem.k} is not a multiple of 16 (16-byte fp8 rows)"
        if reason is None and self.tiles.tma and not problem.device.has_tma:
            # By pointer loads this tiling's accumulators spill: many times slower, the same bits.
            return "loads its tiles through TMA, which needs an NVIDIA GPU of SM90 or later"
        inside = problem.scheme == "block" or problem.static_input_scale
        if reason is None and self.tiles.quantize_x and not inside:
            return "quantizes x inside with a static scale or per 1x128 group (a per-token scale needs its row's amax)"
        return reason

    def batch_variance(self, problem: GemmProblem) -> str | None:
        return None

    def prepare(self, device: torch.device) -> None:
        if device.type == "cuda":
            reserve_counters(device)

    def x_quant(self, scheme: Scheme) -> XQuant | None:
        return None if self.tiles.quantize_x else XQuant(scheme)

    def run(self, x: torch.Tensor, operands: LinearOperands) -> torch.Tensor:
        """x quantized by fp8route's Triton quantizers at every dtype (each computes a row from that row
        alone; torch's fp32 path reduces in an order that may follow M), then the GEMM."""
        x, o = x.contiguous(), operands
        if self.tiles.quantize_x:
            x_scale = None if o.scheme == "block" else o.input_scale
            bias = bias_as(o, x.dtype)
            return custom_ops.fixed_gemm(x, o.weight, x_scale, o.weight_scale, bias, x.dtype, self._tiles)
        if o.scheme == "block":
            x_q, x_scale = triton_quantize.quantize_per_group(x)
        elif o.scheme == "channel" or o.input_scale is None:
            # A dynamic per-tensor scale is the amax of the whole batch; each row's own amax is not. The
            # GEMM takes per-token x scales beside a scalar weight scale as they are.
            x_q, x_scale = triton_quantize.quantize_per_token(x)
        else:
            x_q, x_scale = triton_quantize.quantize_fp8(x, o.input_scale), o.input_scale
        return self.run_quantized(x_q, x_scale, o, x.dtype)

    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        o = operands
        bias = bias_as(o, out_dtype)
        return custom_ops.fixed_gemm(x_q, o.weight, x_scale, o.weight_scale, bias, out_dtype, self._tiles_quantized)
